"""SCOUT's hang rule counts training collectives only, not lm-resiliency's own transfers.

A 4-rank DDP job with GEMINI replication (jump 2) and SCOUT trains and captures; rank 1 then
loses its own shards, so the restart recovers rank 1 from the replica rank 3 holds: rank 3's
recovery sender thread and rank 1's training thread make peer transfers that ranks 0 and 2 do
not. Healthy training follows (short hang threshold, no report allowed), then a last capture is
replicated in the background, and rank 3 blocks in a barrier on {1, 3} that rank 1 never joins
while ranks 0, 1 and 2 wait in a world all_reduce. The report must name rank 3 and that barrier
within 2x the threshold, and no rank's last operation may be a GEMINI transfer.
"""

import json
import os
import threading
import time

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, ReplayHarnessConfig, enable_resiliency
from tests.distributed.session_workloads import Net, batch
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(400)

THRESHOLD_S = 3.0
POLL_S = 0.2
HEALTHY_S = 2 * THRESHOLD_S
WATCHDOG_S = 120.0
RUN_ID = "library-traffic"


def _write_json(path, payload):
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def _watchdog(out_dir, rank):
    deadline = time.monotonic() + WATCHDOG_S
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(out_dir, "stop")):
            os._exit(0)
        time.sleep(0.05)
    _write_json(os.path.join(out_dir, f"watchdog-{rank}.json"), {"rank": rank})
    os._exit(3)


def _session(folder, threshold_s, on_report=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = enable_resiliency(
        ddp, optimizer, interval=2, oob_fault_callback=on_report,
        checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id=RUN_ID,
                                      replication_jump=2, timeout_s=60, host_memory="heap"),
        replay=ReplayHarnessConfig(hang_stall_threshold_s=threshold_s, monitor_poll_interval_s=POLL_S))
    return session, ddp, optimizer


def _step(ddp, optimizer, step, stop=0.0):
    """One training step; its world all_reduce (the stop vote) is the traced training collective."""
    import torch.distributed as dist

    ddp(batch(step, dist.get_rank(), 32)).pow(2).mean().backward()
    vote = torch.tensor([stop])
    dist.all_reduce(vote)
    optimizer.step()
    optimizer.zero_grad()
    return vote.item() > 0


def _first_run(rank, world, folder):
    session, ddp, optimizer = _session(folder, threshold_s=600.0)
    for step in range(4):
        _step(ddp, optimizer, step)
    session.flush_for_restart()
    store = session.manager.store
    own = [os.path.join(store.directory, key.file_name) for key in store.list_shards() if key.kind == "own"]
    session.close()
    return own


def _restart_then_hang(rank, world, folder, out_dir):
    import torch.distributed as dist

    threading.Thread(target=_watchdog, args=(out_dir, rank), daemon=True).start()
    phase = {"name": "recovery"}

    def on_report(report):
        _write_json(os.path.join(out_dir, f"report-{rank}.json"),
                    dict(report.to_json(), phase=phase["name"], reported_at=time.time()))
        open(os.path.join(out_dir, "stop"), "w").close()
        os._exit(0)

    sub = dist.new_group([1, 3])                  # every rank creates it; only rank 3 uses it
    session, ddp, optimizer = _session(folder, THRESHOLD_S, on_report)
    _write_json(os.path.join(out_dir, f"recovered-{rank}.json"),
                {"step": session.step_count, "sources": session.manager.recovery_sources})
    phase["name"] = "healthy"
    deadline = time.monotonic() + HEALTHY_S
    step = session.step_count
    while not _step(ddp, optimizer, step, stop=float(time.monotonic() >= deadline)):
        step += 1
        time.sleep(0.02)
    session.flush_for_restart()                   # the last capture's replication has run
    phase["name"] = "hang"
    try:
        if rank == 3:
            _write_json(os.path.join(out_dir, "blocked.json"), {"at": time.time()})
            dist.barrier(group=sub)               # rank 1 never joins: blocks forever
        else:
            dist.all_reduce(torch.ones(1))        # rank 3 never joins: blocks forever
    except Exception:
        # Once the reporting rank exits, gloo may fail a blocked collective first: planned teardown.
        if os.path.exists(os.path.join(out_dir, "stop")):
            os._exit(0)
        raise
    return "not blocked"


def test_hang_after_asymmetric_peer_recovery_names_the_blocked_rank(tmp_path):
    folder, out_dir = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out_dir)
    own = run_ranks(_first_run, 4, folder, timeout=200)
    for path in own[1]:                           # rank 1 must recover from rank 3's replica
        os.remove(path)

    outcomes = run_ranks(_restart_then_hang, 4, folder, out_dir, timeout=WATCHDOG_S + 60, check=False)

    assert [(o.rank, o.exitcode, o.error) for o in outcomes] == [(r, 0, None) for r in range(4)], outcomes
    assert not any(name.startswith("watchdog") for name in os.listdir(out_dir))
    recovered = {}
    for rank in range(4):
        with open(os.path.join(out_dir, f"recovered-{rank}.json")) as f:
            recovered[rank] = json.load(f)
    assert {r: v["step"] for r, v in recovered.items()} == {r: 4 for r in range(4)}
    assert "held:1" in recovered[3]["sources"] and "own:1" not in recovered[1]["sources"]

    reports = sorted(name for name in os.listdir(out_dir) if name.startswith("report-"))
    assert reports == ["report-0.json"], reports
    with open(os.path.join(out_dir, reports[0])) as f:
        report = json.load(f)
    assert report["phase"] == "hang", report  # nothing reported during recovery or healthy training
    assert report["kind"] == "hang" and report["ranks"] == [3], report
    assert report["resource"] == "barrier(group=[1,3])"
    ranks = report["evidence"]["ranks"]
    assert {r: v["op"] for r, v in ranks.items()} == {
        "0": "all_reduce", "1": "all_reduce", "2": "all_reduce", "3": "barrier(group=[1,3])"}
    assert len({v["collectives"] for v in ranks.values()}) == 1, ranks
    for view in ranks.values():  # the training thread's own last op; GEMINI's transfers are not ops at all
        assert view["last_op"] in ("all_reduce", "scout_replay", "scout_probe", "scout_step_timings"), ranks
    with open(os.path.join(out_dir, "blocked.json")) as f:
        blocked_at = json.load(f)["at"]
    latency = report["detected_at"] - blocked_at
    print(f"\nhang detection latency after asymmetric recovery: {latency:.2f}s (threshold {THRESHOLD_S}s)")
    assert latency <= 2 * THRESHOLD_S, latency
