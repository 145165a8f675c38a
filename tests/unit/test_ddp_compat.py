"""lm_resiliency/_torch_compat.py: the private torch API it relies on, and what its DDP parts do to
a DDP: the pin (Lightning, Accelerate), the layout kept across a restart (plain PyTorch) and the
reducer's own averaging (SCOUT's gradient trace).

The first test fails loudly when a torch upgrade renames or reshapes any private name they use;
the others run real DDP over gloo (tests/harness.py): 2 ranks for the pin, 3 where summation order
shows (with 2 ranks `a + b` commutes)."""

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
    for name in ("parameters", "gradients", "buffer"):
        assert callable(getattr(dist.GradBucket, name, None)), f"torch.distributed.GradBucket.{name} is gone"
    assert callable(getattr(torch.Tensor, "register_post_accumulate_grad_hook", None))
    init = inspect.signature(DDP.__init__).parameters
    assert "batched_grad_copy" in init and "gradient_as_bucket_view" in init, \
        "DistributedDataParallel's gradient-copy options changed: review ReducerAverage"


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


# ------------------------------------------------------------------ layout kept across a restart

def _fresh(rank, cap=0.002, **ddp_kw):
    torch.manual_seed(0)
    model = Forward()
    return DDP(model, bucket_cap_mb=cap, **ddp_kw), model


def _layout_across_restart(rank, world):
    # A: DDP's own rebuild, after its first iteration (in the second forward).
    own, _ = _fresh(rank)
    optimizer = torch.optim.SGD(own.parameters(), lr=0.1)
    initial = _torch_compat.bucket_layout(own)
    _step(own, optimizer, rank, 0)
    _step(own, optimizer, rank, 1)
    rebuilt = _torch_compat.bucket_layout(own)
    # B: a capture right after step 1 runs that rebuild now and records its layout.
    captured, _ = _fresh(rank)
    _step(captured, torch.optim.SGD(captured.parameters(), lr=0.1), rank, 0)
    settled = _torch_compat.settled_bucket_layout(captured)
    # C: a fresh process resuming: the recorded layout, exactly, and never rebuilt again.
    resumed, _ = _fresh(rank)
    restored = _torch_compat.restore_bucket_layout(resumed, settled)
    before = _torch_compat.bucket_layout(resumed)
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    _step(resumed, optimizer, rank, 1)
    _step(resumed, optimizer, rank, 2)
    unused, _ = _fresh(rank, find_unused_parameters=True)
    _step(unused, torch.optim.SGD(unused.parameters(), lr=0.1), rank, 0)
    return {"initial": initial, "rebuilt": rebuilt, "settled": settled, "restored": restored, "before": before,
            "after": _torch_compat.bucket_layout(resumed), "flag": resumed._has_rebuilt_buckets,
            "unused": _torch_compat.settled_bucket_layout(unused)}


def test_layout_is_ddps_own_rebuild_recorded_after_step_one_and_restored_exactly():
    for r in run_ranks(_layout_across_restart, 3, timeout=90):
        assert r["initial"] != r["rebuilt"]  # there is a rebuild to keep
        assert r["settled"] == r["rebuilt"] and len(r["rebuilt"]) > 1
        assert r["restored"] is True and r["flag"] is True
        assert r["before"] == r["after"] == r["rebuilt"]
        assert r["unused"] is None  # find_unused_parameters: DDP never rebuilds, nothing to keep


def _restore_refusals(rank, world):
    warnings = _Warnings()
    logging.getLogger(_torch_compat.__name__).addHandler(warnings)
    ddp, _ = _fresh(rank)
    layout = _torch_compat.bucket_layout(ddp)
    out = {"warnings": warnings.messages}
    for name, bad in (("renamed", [["head.weight", "head.bias", "layers.9.weight"]]),
                      ("repeated", layout + [["head.bias"]]), ("not_names", [[1, 2]])):
        try:
            _torch_compat.restore_bucket_layout(ddp, bad)
        except ValueError as exc:
            out[name] = str(exc)
    trained, _ = _fresh(rank)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    _step(trained, optimizer, rank, 0)
    _step(trained, optimizer, rank, 1)
    out["trained"] = _torch_compat.restore_bucket_layout(trained, layout)
    hooked, _ = _fresh(rank)
    hooked._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    out["builtin_hook"] = _torch_compat.restore_bucket_layout(hooked, layout)
    # DDP's initial single bucket is no layout its rebuild can produce under a 2 KB cap.
    out["unreproducible"] = _torch_compat.restore_bucket_layout(ddp, layout)
    return out


def test_restore_refuses_a_layout_of_other_parameters_and_warns_where_it_cannot_apply():
    for r in run_ranks(_restore_refusals, 2, timeout=90):
        assert "missing ['layers.0.bias'" in r["renamed"] and "unexpected ['layers.9.weight']" in r["renamed"]
        assert "repeated ['head.bias']" in r["repeated"]
        assert "not a list of lists of parameter names" in r["not_names"]
        assert r["trained"] is False and r["builtin_hook"] is False and r["unreproducible"] is False
        trained, hooked, unreproducible = r["warnings"]
        assert "DDP already ran a backward pass" in trained and "built-in DDP communication hook" in hooked
        assert "DDP rebuilt 4 bucket(s) from the recovered order, not the 1 recorded" in unreproducible
        assert all("can differ from an uninterrupted one in the last bits" in m for m in r["warnings"])


# ------------------------------------------------------------------ the reducer's own averaging

def _averaged(rank, world, ddp_kw, set_to_none):
    """The all-reduced gradients of 4 steps: DDP without a hook, with ReducerAverage, with allreduce_hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    runs = {}
    for hook in (None, "reducer", "allreduce_hook"):
        ddp, model = _fresh(rank, **ddp_kw)
        if hook == "reducer":
            ddp.register_comm_hook(None, _torch_compat.ReducerAverage(ddp).__call__)
        elif hook == "allreduce_hook":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = runs[hook] = []
        for step in range(4):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            ddp(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    return runs


@pytest.mark.parametrize("ddp_kw,set_to_none", [
    ({}, True), ({"gradient_as_bucket_view": True}, True), ({"gradient_as_bucket_view": True}, False),
    ({"batched_grad_copy": True}, True)],
    ids=["default", "bucket_view", "bucket_view_zeroed_in_place", "batched_grad_copy"])
def test_reducer_average_is_ddps_own_arithmetic_on_three_ranks(ddp_kw, set_to_none):
    """Every all-reduced gradient of every step bitwise equal to DDP without a hook; torch's
    allreduce_hook (divide, then sum) differs unless the reducer divides every gradient too."""
    runs = run_ranks(_averaged, 3, ddp_kw, set_to_none, timeout=90)

    def same(hook):
        return all(torch.equal(x, y) for r in runs for step in range(4) for x, y in zip(r[hook][step], r[None][step]))

    assert same("reducer")
    # Only batched_grad_copy divides every gradient (in-place zeroing still copies at step 1).
    assert same("allreduce_hook") == ("batched_grad_copy" in ddp_kw)
