"""Whole-rank stragglers and non-finite origins without SCOUT's DDP bucket trace, on 4 real gloo
ranks under `enable_resiliency`: a plain loop that all-reduces its gradients itself, FSDP2
(`fully_shard` per layer and on the root), and DDP whose user comm hook was registered before the
session (DDP lets nobody wrap it: it runs unchanged and training is bitwise what it is alone).

Every rank works ~50 ms per step (a sleep in a middle layer stands for compute). Checks run at
steps 4, 8 and 12; steps 1-2 are start-up and check steps' forwards are slower on every rank, so the
rounds judge step 3, then steps 5-7.
"""

import time

import pytest
import torch
from torch import nn

from tests.distributed.test_scout_ddp_trace import Tower, _batch, assert_straggler_contract
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

KINDS = ["plain", "fsdp2", "ddp_hook"]


def _counting_allreduce(calls):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def user_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)
    return user_hook


def _build(kind, calls):
    """(model, what the loop calls, optimizer) as users build them."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Tower()
    if kind == "plain":
        wrapped = model
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
        wrapped.register_comm_hook(None, _counting_allreduce(calls))
    return model, wrapped, torch.optim.SGD(model.parameters(), lr=0.05)


def _step(kind, model, wrapped, optimizer, batch):
    import torch.distributed as dist

    wrapped(batch).pow(2).mean().backward()
    if kind == "plain":   # the loop reduces its own gradients
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    optimizer.step()
    optimizer.zero_grad()


def _run(rank, world, kind, scenario, fault_rank, steps=8):
    """scenario: "start" (`fault_rank` sleeps 100 ms more at the start of each iteration: with the
    frameworks' own work under test load, about 2x its peers' step),
    "layer" (its middle layer is 5x slower), "nan" (one NaN in its middle layer's output at step
    6), "shard" (FSDP2: one NaN in its stored shard of the middle layer's weight before step 6),
    "clean". Returns [(step, not-clean checks, stragglers)] from fault_callback, and whether
    the user's comm hook ran."""
    from lm_resiliency import ReplayHarnessConfig, enable_resiliency

    calls = []
    model, wrapped, optimizer = _build(kind, calls)
    state = {"step": 0}
    slow = rank == fault_rank and scenario == "layer"
    model.layers[1].register_forward_pre_hook(lambda module, args: time.sleep(0.25 if slow else 0.05))

    def poison(module, args, output):
        if rank == fault_rank and scenario == "nan" and state["step"] == 6:
            output = output.clone()
            output[0, 0] = float("nan")
        return output

    model.layers[1].register_forward_hook(poison)
    results = []
    session = enable_resiliency(wrapped, optimizer, interval=4, enable_checkpoint=False,
                                fault_callback=results.append, replay=ReplayHarnessConfig(hang_stall_threshold_s=120))
    for step in range(1, steps + 1):
        state["step"] = step
        if rank == fault_rank and scenario == "start":
            time.sleep(0.1)
        if rank == fault_rank and scenario == "shard" and step == 6:   # this rank's stored FSDP2 shard
            with torch.no_grad():
                model.layers[1].weight.to_local().view(-1)[0] = float("nan")
        _step(kind, model, wrapped, optimizer, _batch(step, rank))
    session.close()
    seen = [(r.step, [(c.check, c.module_path, list(c.faulty), c.detail) for c in r.checks if c.verdict != "clean"],
             [(f.kind, list(f.ranks), f.confirmed, f.evidence.get("measure"), f.evidence.get("rounds"),
               f.evidence.get("required_rounds")) for f in r.stragglers])
            for r in results]
    return seen, bool(calls) if kind == "ddp_hook" else None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["start", "layer"])
def test_whole_rank_straggler_is_named_within_two_rounds(kind, where):
    for rank, (seen, hook_ran) in enumerate(run_ranks(_run, 4, kind, where, 2, 12, timeout=240)):
        assert hook_ran in (None, True)
        confirmed = [(step, f) for step, _, stragglers in seen for f in stragglers if f[2]]
        # Confirmed at the second check (step 8); a round disturbed by machine load (the first
        # one times step 3 only) moves that to the third.
        assert confirmed and confirmed[0][0] in (8, 12), (rank, seen)
        assert_straggler_contract(rank, seen, 2)   # an unconfirmed suspicion may name a healthy rank
        assert all(checks == [] for _, checks, _ in seen), (rank, seen)


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_origin_is_named_at_the_next_check(kind):
    # Rank 1's NaN appears at step 6 and reaches every replica through the step-6 reduction; at
    # the step-8 check the peers compare where they first saw non-finite values.
    for rank, (seen, hook_ran) in enumerate(run_ranks(_run, 4, kind, "nan", 1, timeout=240)):
        assert hook_ran in (None, True)
        origin = [(step, c) for step, checks, _ in seen for c in checks if c[0] == "gradients"]
        assert len(origin) == 1, (rank, seen)
        step, (_, path, faulty, detail) = origin[0]
        assert (step, path, faulty) == (8, "non_finite", [1]), (rank, seen)
        assert "at step 6" in detail, detail


def test_non_finite_fsdp2_shard_is_named_on_the_rank_that_holds_it():
    # Every rank gathers the NaN shard into its forward at step 6; only rank 1 sent it.
    for rank, (seen, _) in enumerate(run_ranks(_run, 4, "fsdp2", "shard", 1, timeout=240)):
        origin = [(step, c) for step, checks, _ in seen for c in checks if c[0] == "gradients"]
        assert [(step, c[2]) for step, c in origin] == [(8, [1])], (rank, seen)
        assert "at step 6" in origin[0][1][3] and "all_gather_single" in origin[0][1][3], origin


def test_clean_run_reports_nothing():
    for kind in KINDS:
        for seen, hook_ran in run_ranks(_run, 4, kind, "clean", None, timeout=240):
            assert seen == [] and hook_ran in (None, True), (kind, seen)


def _bitwise(rank, world, with_session):
    from lm_resiliency import enable_resiliency

    calls = []
    model, ddp, optimizer = _build("ddp_hook", calls)
    session = enable_resiliency(ddp, optimizer, interval=2, enable_checkpoint=False) if with_session else None
    for step in range(1, 6):
        _step("ddp_hook", model, ddp, optimizer, _batch(step, rank))
    if session is not None:
        session.close()
    return [p.detach().clone() for p in model.parameters()], len(calls)


def test_user_hook_registered_first_runs_unchanged_and_training_is_bitwise_equal():
    alone = run_ranks(_bitwise, 4, False, timeout=150)
    traced = run_ranks(_bitwise, 4, True, timeout=150)
    for (plain, plain_calls), (ours, our_calls) in zip(alone, traced):
        assert plain_calls == our_calls > 0
        assert all(torch.equal(a, b) for a, b in zip(plain, ours))


def test_hang_under_ddp_with_a_user_hook_registered_first_is_named_exactly(tmp_path):
    from tests.distributed.test_scout_ddp_trace import _ddp_hang, only_hang_report

    out_dir = str(tmp_path)
    report, _ = only_hang_report(out_dir, run_ranks(_ddp_hang, 4, out_dir, 3, 6, True, timeout=150, check=False))
    assert (report["kind"], report["scope"], report["ranks"]) == ("hang", "rank", [3]), report["evidence"]
    ops = {r: v["op"] for r, v in report["evidence"]["ranks"].items()}
    assert ops == {"0": "comm:ddp_grad_bucket", "1": "comm:ddp_grad_bucket", "2": "comm:ddp_grad_bucket",
                   "3": None}, ops
