"""adapters/_torch_compat.py: the private torch API it relies on, and what the pin does to a DDP.

The first test fails loudly when a torch upgrade renames or reshapes any private name the pin
uses; the others run real DDP over gloo (2 ranks, tests/harness.py)."""

import inspect
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import _torch_compat
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_private_torch_api_is_the_checked_one():
    helper = inspect.signature(DDP._ddp_init_helper)
    assert list(helper.parameters) == ["self", "parameters", "expect_sparse_gradient", "param_to_name_mapping",
                                       "static_graph"], (
        f"torch {torch.__version__} changed DistributedDataParallel._ddp_init_helper (checked against "
        f"{_torch_compat.TORCH_CHECKED}): review adapters/_torch_compat.py")
    for name in ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_get_ddp_logging_data",
                 "_set_static_graph"):
        assert callable(getattr(DDP, name, None)), f"DistributedDataParallel.{name} is gone"
    for name in ("_push_all_rebuilt_params", "_rebuild_buckets", "_set_static_graph", "_get_zeros_like_grad_buckets"):
        assert callable(getattr(dist.Reducer, name, None)), f"torch.distributed.Reducer.{name} is gone"
    assert callable(getattr(dist.Logger, "_set_static_graph", None))
    assert callable(getattr(dist.GradBucket, "parameters", None))


class Forward(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _step(ddp, optimizer, rank, step):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))
    ddp(x).pow(2).mean().backward()
    grads = [p.grad.clone() for p in ddp.module.parameters()]
    optimizer.step()
    optimizer.zero_grad()
    return grads


def _pinned_then_trained(rank, world, ddp_kw, pin):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = Forward()
    hook = ddp_kw.pop("comm_hook", None)
    ddp = DDP(model, bucket_cap_mb=0.002, **ddp_kw)
    if hook is not None:  # registered before the pin: it must carry over to the new reducer
        ddp.register_comm_hook(None, getattr(default_hooks, hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pinned = _torch_compat.pin_bucket_layout(ddp) if pin else None
    layout = _torch_compat.bucket_layout(ddp)
    grads = [_step(ddp, optimizer, rank, step) for step in range(3)]
    hooks = [h.__name__ for h, _ in ddp._comm_hooks]
    return pinned, layout, _torch_compat.bucket_layout(ddp), grads, _torch_compat.find_wrapper(model) is ddp, hooks


# A bucket closes once it reaches bucket_cap_mb (about 2 KB here).
REVERSED = [["head.bias", "head.weight", "layers.2.bias", "layers.2.weight"], ["layers.1.bias", "layers.1.weight"],
            ["layers.0.bias", "layers.0.weight"]]


@pytest.mark.parametrize("ddp_kw", [{}, {"static_graph": True}, {"gradient_as_bucket_view": True},
                                    {"comm_hook": "fp16_compress_hook"}],
                         ids=["default", "static_graph", "gradient_as_bucket_view", "comm_hook"])
def test_pin_fixes_reverse_registration_layout_and_keeps_gradients(ddp_kw):
    pinned = run_ranks(_pinned_then_trained, 2, dict(ddp_kw), True, timeout=90)
    plain = run_ranks(_pinned_then_trained, 2, dict(ddp_kw), False, timeout=90)
    for rank in range(2):
        ok, before, after, grads, found, hooks = pinned[rank]
        assert ok and found
        assert hooks == plain[rank][5] == ([ddp_kw["comm_hook"]] if "comm_hook" in ddp_kw else [])
        # Reverse registration order in DDP's bucket sizes, from the first step on, never rebuilt.
        assert before == after == REVERSED
        # Two ranks sum commutatively: the all-reduced gradients do not depend on the layout (with
        # the fp16 hook, equal only if the hook ran on the pinned reducer too).
        for got, want in zip(grads, plain[rank][3]):
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert plain[0][1] != REVERSED  # DDP's own first layout differs: there is something to pin


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _refusals(rank, world):
    torch.manual_seed(0)
    warnings = _Warnings()
    logging.getLogger(_torch_compat.__name__).addHandler(warnings)
    results = {"warnings": warnings.messages}
    trained = DDP(Forward(), bucket_cap_mb=0.005)
    _step(trained, torch.optim.SGD(trained.parameters(), lr=0.1), rank, 0)
    _step(trained, torch.optim.SGD(trained.parameters(), lr=0.1), rank, 1)
    results["trained"] = _torch_compat.pin_bucket_layout(trained)
    hooked = DDP(Forward())
    hooked._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    results["comm_hook"] = _torch_compat.pin_bucket_layout(hooked)
    unused = DDP(Forward(), bucket_cap_mb=0.005, find_unused_parameters=True)
    layout = _torch_compat.bucket_layout(unused)
    results["find_unused"] = (_torch_compat.pin_bucket_layout(unused), layout == _torch_compat.bucket_layout(unused))
    results["unwrapped"] = _torch_compat.find_wrapper(Forward())
    return results


def test_refuses_what_it_cannot_pin_and_leaves_fixed_layouts():
    results = run_ranks(_refusals, 2, timeout=90)
    for r in results:
        assert r["trained"] is False and r["comm_hook"] is False
        trained, hooked = r["warnings"]
        assert "DDP already ran a backward pass before lm-resiliency attached" in trained
        assert "a built-in DDP communication hook is registered" in hooked
        assert all("a resumed run can differ from an uninterrupted one" in m for m in r["warnings"])
        assert r["find_unused"] == (True, True)  # DDP never rebuilds: nothing to do
        assert r["unwrapped"] is None


def test_switched_off_does_nothing():
    assert _torch_compat._ENABLED
    _torch_compat._ENABLED = False
    try:
        assert _torch_compat.pin_bucket_layout(object()) is False
    finally:
        _torch_compat._ENABLED = True
