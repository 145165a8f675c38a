"""How SCOUT's DDP gradient-bucket trace composes with the user's own comm hooks and GradScaler,
on 2 real gloo ranks (the 4-rank bitwise and detection tests are in test_scout_ddp_trace.py)."""

import logging

import pytest
import torch

from tests.distributed.test_scout_ddp_trace import Tower, _batch
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


def _train(ddp, model, optimizer, steps=3):
    for step in range(1, steps + 1):
        ddp(_batch(step, torch.distributed.get_rank())).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _composition(rank, world):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import enable_resiliency
    from lm_resiliency.scout import ddp_trace

    def fresh():
        torch.manual_seed(0)
        model = Tower()
        return model, DDP(model), torch.optim.SGD(model.parameters(), lr=0.05)

    out = {}
    # The built-in FP16_COMPRESS registered after the session runs as its Python equivalent.
    model, ddp, optimizer = fresh()
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    plain = _train(ddp, model, optimizer)
    model, ddp, optimizer = fresh()
    session = enable_resiliency(ddp, optimizer, interval=2, enable_checkpoint=False)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    out["builtin_fp16_bitwise"] = all(torch.equal(a, b) for a, b in zip(plain, _train(ddp, model, optimizer)))
    # A second registration fails as DDP's own does.
    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as exc:
        out["second"] = str(exc)
    trace = session.scout._ddp_trace
    session.close()
    # After close the hook only reduces: nothing accumulates, DDP's methods are its own again.
    _train(ddp, model, optimizer, steps=1)
    out["after_close"] = (trace._local, trace._reduced, "register_comm_hook" in ddp.__dict__)

    model, ddp, optimizer = fresh()
    session = enable_resiliency(ddp, optimizer, interval=2, enable_checkpoint=False)
    try:
        ddp._register_builtin_comm_hook("not-a-hook-type")
    except RuntimeError as exc:
        out["unknown_builtin"] = str(exc)
    session.close()

    # A hook registered before the session cannot be wrapped: it runs unchanged and SCOUT watches
    # the parameters' gradients instead (test_scout_local_trace.py tests what that detects).
    model, ddp, optimizer = fresh()
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(ddp_trace.__name__)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    session = enable_resiliency(ddp, optimizer, interval=2, enable_checkpoint=False)
    out["before"] = (session.scout._ddp_trace is None, session.scout._local is not None,
                     [(r.levelname, r.getMessage()) for r in records])
    session.close()
    return out


def test_user_hooks_compose_whether_registered_after_or_before_the_session():
    for rank, out in enumerate(run_ranks(_composition, 2, timeout=150)):
        assert out["builtin_fp16_bitwise"], rank
        assert out["second"] == "register_comm_hook or register_builtin_comm_hook can only be called once."
        assert out["after_close"] == ([], [], False), out["after_close"]
        assert "not-a-hook-type" in out["unknown_builtin"] and "register_comm_hook" in out["unknown_builtin"]
        no_bucket_trace, watched, messages = out["before"]
        assert no_bucket_trace and watched and len(messages) == 1, out["before"]
        level, message = messages[0]
        assert level == "INFO" and "allreduce_hook" in message and "runs unchanged" in message, message


def _scaler_skip(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import enable_resiliency

    torch.manual_seed(0)
    model = Tower()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    reports, state = [], {"step": 0}

    def overflow(module, args, output):
        return output * float("inf") if rank == 1 and state["step"] == 3 else output

    model.layers[0].register_forward_hook(overflow)
    session = enable_resiliency(ddp, optimizer, interval=2, enable_checkpoint=False, scaler=scaler,
                                oob_fault_callback=reports.append)
    for step in range(1, 6):
        state["step"] = step
        scaler.scale(ddp(_batch(step, rank)).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    session.close()
    return reports, finite, session.step_count


def test_overflow_a_grad_scaler_skips_is_not_reported():
    for rank, (reports, finite, steps) in enumerate(run_ranks(_scaler_skip, 2, timeout=150)):
        assert reports == [] and finite and steps == 5, (rank, reports, finite, steps)
