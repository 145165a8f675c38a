"""SCOUT through DDP's comm-hook seam, on 4 real gloo ranks with real DDP and `enable_resiliency`:

* a rank that hangs in its forward is named exactly (DDP's bucket all-reduce runs in C++, so
  without the bucket trace every rank looked alike: "all ranks stalled", peer_group scope);
* a whole-rank straggler (slow at the start of every iteration, or in a middle layer) is named
  within 2 confirmation rounds, and a clean run reports nothing;
* one NaN injected into one rank's output is reported as SDC on that rank only, at the step it
  appeared, and that interval is not captured;
* a user's own comm hook still runs, and training is bitwise equal to plain DDP.
"""

import json
import os
import threading
import time

import pytest
import torch
from torch import nn

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

THRESHOLD_S = 2.0
POLL_S = 0.2
WATCHDOG_S = 60.0


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.tanh(self.embed(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _batch(step, rank):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + step))


def _write_json(path, payload):
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def _watchdog(out_dir, rank):
    stop = os.path.join(out_dir, "stop")
    deadline = time.monotonic() + WATCHDOG_S
    while time.monotonic() < deadline:
        if os.path.exists(stop):
            os._exit(0)
        time.sleep(0.05)
    _write_json(os.path.join(out_dir, f"watchdog-{rank}.json"), {"rank": rank})
    os._exit(3)


# ----------------------------------------------------------------------------------------- hang


def _ddp_hang(rank, world, out_dir, hung_rank, hang_step, user_hook_first=False):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import ReplayHarnessConfig, enable_resiliency

    threading.Thread(target=_watchdog, args=(out_dir, rank), daemon=True).start()
    torch.manual_seed(0)
    model = Tower()
    ddp = DDP(model)
    if user_hook_first:   # SCOUT cannot wrap it and watches the parameters' gradients instead
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def on_report(report):
        _write_json(os.path.join(out_dir, f"report-{rank}.json"), dict(report.to_json(), reported_at=time.time()))
        open(os.path.join(out_dir, "stop"), "w").close()
        os._exit(0)

    session = enable_resiliency(ddp, optimizer, interval=4, enable_checkpoint=False, oob_fault_callback=on_report,
                                replay=ReplayHarnessConfig(hang_stall_threshold_s=THRESHOLD_S,
                                                           monitor_poll_interval_s=POLL_S))

    def hang(module, args):
        _write_json(os.path.join(out_dir, "blocked.json"), {"at": time.time()})
        time.sleep(WATCHDOG_S * 2)

    for step in range(1, 13):
        if rank == hung_rank and step == hang_step:
            model.layers[1].register_forward_pre_hook(hang)
        try:
            ddp(_batch(step, rank)).pow(2).mean().backward()
        except Exception:
            if os.path.exists(os.path.join(out_dir, "stop")):
                os._exit(0)  # the reporting rank ended the run: gloo fails the blocked all-reduce
            raise
        optimizer.step()
        optimizer.zero_grad()
    session.close()
    return "not blocked"


def only_hang_report(out_dir, outcomes):
    """Every rank exited cleanly and exactly one rank reported: (its report, when the rank blocked)."""
    assert [(o.rank, o.exitcode, o.error) for o in outcomes] == [(r, 0, None) for r in range(4)], outcomes
    reports = sorted(n for n in os.listdir(out_dir) if n.startswith("report-"))
    assert len(reports) == 1, reports
    with open(os.path.join(out_dir, reports[0])) as f:
        report = json.load(f)
    with open(os.path.join(out_dir, "blocked.json")) as f:
        blocked_at = json.load(f)["at"]
    return report, blocked_at


def test_ddp_hang_in_forward_is_named_exactly(tmp_path):
    out_dir = str(tmp_path)
    outcomes = run_ranks(_ddp_hang, 4, out_dir, 3, 10, timeout=120, check=False)
    report, blocked_at = only_hang_report(out_dir, outcomes)
    assert report["kind"] == "hang" and report["scope"] == "rank", report
    assert report["ranks"] == [3], report["evidence"]
    ops = {r: v["op"] for r, v in report["evidence"]["ranks"].items()}
    assert ops == {"0": "comm:ddp_grad_bucket", "1": "comm:ddp_grad_bucket", "2": "comm:ddp_grad_bucket",
                   "3": None}, ops
    latency = report["detected_at"] - blocked_at
    assert THRESHOLD_S * 0.5 <= latency <= 2 * THRESHOLD_S, latency


# ------------------------------------------------------------------------------------ stragglers


def _ddp_stragglers(rank, world, slow_rank, where, steps):
    """Every rank works ~20 ms per step (a sleep in a middle layer stands for compute); the slow
    rank adds `where`: "start" sleeps 20 ms more at the start of each iteration (2x), "layer"
    makes the middle layer 5x slower."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import ReplayHarnessConfig, enable_resiliency

    torch.manual_seed(0)
    model = Tower()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    work_s = 0.1 if (rank == slow_rank and where == "layer") else 0.02
    model.layers[1].register_forward_pre_hook(lambda module, args: time.sleep(work_s))
    results = []
    session = enable_resiliency(ddp, optimizer, interval=4, enable_checkpoint=False,
                                fault_callback=results.append,
                                replay=ReplayHarnessConfig(hang_stall_threshold_s=120))
    for step in range(1, steps + 1):
        if rank == slow_rank and where == "start":
            time.sleep(0.02)
        ddp(_batch(step, rank)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    session.close()
    return [(r.step, [(f.kind, list(f.ranks), f.confirmed, f.evidence.get("measure"), f.evidence.get("rounds"),
                       f.evidence.get("required_rounds")) for f in r.stragglers])
            for r in results]


KNOWN_MEASURES = ("replay_compute", "rank_step_work", "collective_probe", "all_to_all_replay")


def assert_straggler_contract(rank, seen, faulty):
    """What a straggler finding may say (docs/scout.md, "What a straggler finding says"): a
    confirmed one names the faulty rank only, and is confirmed by the rank's own work per step;
    an unconfirmed one may name any rank (one noisy round of one measure), and says which measure
    and how many of the required rounds. `seen` is [(step, ..., [(kind, ranks, confirmed,
    measure, rounds, required)])] from one rank's fault_callback."""
    findings = [f for entry in seen for f in entry[-1]]
    confirmed = [f for f in findings if f[2]]
    assert confirmed and all(f[1] == [faulty] for f in confirmed), (rank, seen)
    assert any(f[3] == "rank_step_work" for f in confirmed), (rank, seen)
    assert all(f[3] in KNOWN_MEASURES and f[4] < f[5] for f in findings if not f[2]), (rank, seen)


@pytest.mark.parametrize("where", ["start", "layer"])
def test_whole_rank_straggler_is_named_within_two_rounds(where):
    # Checks at steps 4 and 8, each one round of timings (step 3, then steps 5-7: steps 1-2 are
    # DDP's start-up, check steps' forwards are slower on every rank; both are left out).
    results = run_ranks(_ddp_stragglers, 4, 2, where, 8, timeout=120)
    for rank, seen in enumerate(results):
        confirmed = [(step, f) for step, findings in seen for f in findings if f[2]]
        assert confirmed, (rank, seen)
        assert confirmed[0][0] == 8, (rank, seen)
        assert_straggler_contract(rank, seen, 2)


def test_clean_run_reports_no_straggler_and_no_fault():
    results = run_ranks(_ddp_stragglers, 4, None, "start", 8, timeout=120)
    assert results == [[] for _ in range(4)], results


# ------------------------------------------------------------------------------- non-finite origin


def _ddp_nan(rank, world, folder, nan_rank, nan_step):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import InMemoryCkptConfig, enable_resiliency
    from lm_resiliency.experimental import NonFiniteState

    torch.manual_seed(0)
    model = Tower()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reports, state = [], {"step": 0}

    def poison(module, args, output):
        if rank == nan_rank and state["step"] == nan_step:
            output = output.clone()
            output[0, 0] = float("nan")
        return output

    model.layers[1].register_forward_hook(poison)
    session = enable_resiliency(ddp, optimizer, interval=2, oob_fault_callback=lambda r: reports.append(r.to_json()),
                                checkpoint=InMemoryCkptConfig(disk_folder=folder, run_id="nan-origin",
                                                              replication_jump=1, timeout_s=60))
    finite_grads, refused = [], None
    for step in range(1, 7):
        state["step"] = step
        ddp(_batch(step, rank)).pow(2).mean().backward()
        finite_grads.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        try:
            optimizer.step()
        except NonFiniteState:
            refused = step  # the next boundary refuses the NaN parameters on every rank: training stops
            break
        optimizer.zero_grad()
    session.flush_for_restart()
    session.manager._drain()
    own_steps = sorted(k.step for k in session.manager.store.list_shards() if k.kind == "own")
    session.close()
    return {"reports": reports, "own_steps": own_steps, "finite_grads": finite_grads, "refused": refused}


def test_nan_in_one_rank_is_reported_on_that_rank_before_it_spreads(tmp_path):
    results = run_ranks(_ddp_nan, 4, str(tmp_path), 1, 3, timeout=120)
    for rank, result in enumerate(results):
        # The all-reduce spread it: every replica's reduced gradients are non-finite from step 3 on.
        assert result["finite_grads"] == [True, True, False, False], (rank, result)
        # Step 3's interval (boundary 4) is not captured on any rank and stops training; step 2 was captured.
        assert result["refused"] == 4 and 2 in result["own_steps"] and 4 not in result["own_steps"], (rank, result)
        if rank != 1:
            assert result["reports"] == [], (rank, result)
    (report,) = results[1]["reports"]
    assert report["kind"] == "sdc" and report["scope"] == "rank" and report["ranks"] == [1]
    assert report["step"] == 3 and report["resource"] == "gradients:non_finite"
    assert report["evidence"]["spread_by_all_reduce"] is True
    assert "module.layers.1.weight" in report["evidence"]["parameters"] or \
        "layers.1.weight" in report["evidence"]["parameters"], report["evidence"]


def test_clean_run_with_checkpoints_reports_nothing(tmp_path):
    results = run_ranks(_ddp_nan, 4, str(tmp_path), None, 0, timeout=120)
    for rank, result in enumerate(results):
        assert result["reports"] == [] and all(result["finite_grads"]) and result["refused"] is None, (rank, result)
        assert result["own_steps"][-1] == 6, (rank, result)


# ---------------------------------------------------------------------------------- user comm hooks


def _counting(hook, calls):
    def counted(state, bucket):
        calls.append(bucket.index())
        return hook(state, bucket)
    return counted


def _train_plain_or_traced(rank, traced, user_hook, when):
    """Final parameters after 4 steps; `when`: "after" (user registers after enable_resiliency),
    "before" (before it), None (no user hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import enable_resiliency

    torch.manual_seed(0)
    model = Tower()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    calls = []
    hook = _counting({"allreduce": default_hooks.allreduce_hook,
                      "fp16": default_hooks.fp16_compress_hook}[user_hook], calls) if user_hook else None
    if hook is not None and when == "before":
        ddp.register_comm_hook(None, hook)
    # Untraced: plain DDP, without lm-resiliency (DDP rebuilds its buckets as it would either way).
    session = enable_resiliency(ddp, optimizer, interval=2, enable_checkpoint=False) if traced else None
    if hook is not None and when == "after":
        ddp.register_comm_hook(None, hook)
    for step in range(1, 5):
        ddp(_batch(step, rank)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if session is not None:
        session.close()
    return [p.detach().clone() for p in model.parameters()], len(calls)


def _user_hooks(rank, world):
    out = {}
    for user_hook in (None, "allreduce", "fp16"):
        plain, plain_calls = _train_plain_or_traced(rank, False, user_hook, "before")
        for when in ("after", "before"):
            traced, traced_calls = _train_plain_or_traced(rank, True, user_hook, when)
            out[(user_hook, when)] = (all(torch.equal(a, b) for a, b in zip(plain, traced)),
                                      plain_calls, traced_calls)
    return out


def test_user_comm_hook_still_runs_and_training_is_bitwise_equal():
    for rank, out in enumerate(run_ranks(_user_hooks, 4, timeout=180)):
        for (user_hook, when), (equal, plain_calls, traced_calls) in out.items():
            assert equal, (rank, user_hook, when)
            assert traced_calls == plain_calls, (rank, user_hook, when, plain_calls, traced_calls)
            assert (plain_calls > 0) == (user_hook is not None)


# ------------------------------------------------------------------------------------------- FSDP2


def _fsdp2_hang(rank, world, out_dir, hung_rank, hang_step):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lm_resiliency import ReplayHarnessConfig, enable_resiliency

    threading.Thread(target=_watchdog, args=(out_dir, rank), daemon=True).start()
    torch.manual_seed(0)
    model = Tower()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def on_report(report):
        _write_json(os.path.join(out_dir, f"report-{rank}.json"), dict(report.to_json(), reported_at=time.time()))
        open(os.path.join(out_dir, "stop"), "w").close()
        os._exit(0)

    session = enable_resiliency(model, optimizer, interval=4, enable_checkpoint=False, oob_fault_callback=on_report,
                                replay=ReplayHarnessConfig(hang_stall_threshold_s=THRESHOLD_S,
                                                           monitor_poll_interval_s=POLL_S))

    def hang(module, args):
        _write_json(os.path.join(out_dir, "blocked.json"), {"at": time.time()})
        time.sleep(WATCHDOG_S * 2)

    for step in range(1, 9):
        if rank == hung_rank and step == hang_step:
            model.layers[1].register_forward_pre_hook(hang)
        try:
            model(_batch(step, rank)).pow(2).mean().backward()
        except Exception:
            if os.path.exists(os.path.join(out_dir, "stop")):
                os._exit(0)
            raise
        optimizer.step()
        optimizer.zero_grad()
    session.close()
    return "not blocked"


def test_fsdp2_hang_in_forward_is_named_exactly(tmp_path):
    out_dir = str(tmp_path)
    outcomes = run_ranks(_fsdp2_hang, 4, out_dir, 1, 6, timeout=120, check=False)
    report, blocked_at = only_hang_report(out_dir, outcomes)
    assert report["kind"] == "hang" and report["scope"] == "rank", report
    assert report["ranks"] == [1], report["evidence"]
    latency = report["detected_at"] - blocked_at
    assert THRESHOLD_S * 0.5 <= latency <= 2 * THRESHOLD_S, latency
