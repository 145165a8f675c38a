"""OOB hang detection on 4 real gloo ranks: the monitor works while training threads are blocked.

Rank 2 blocks forever in a barrier on a subgroup {2, 3} that rank 3 never enters; ranks 0, 1
and 3 continue into a world all_reduce that then waits for rank 2. Every rank's monitor runs on
the default c10d store (a FileStore here), out of band. The report must name exactly rank 2
within 2x hang_stall_threshold_s. Ranks end themselves: the reporting rank's on_report writes
the report and a stop file, and a watchdog thread in every rank exits the process when the stop
file appears (or, as a backstop, after a bounded deadline), so no process outlives the test.
"""

import json
import os
import threading
import time

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

THRESHOLD_S = 2.0
POLL_S = 0.2
WATCHDOG_S = 60.0        # backstop: a rank still blocked after this exits with code 3
HARNESS_TIMEOUT_S = 120.0


def _write_json(path, payload):
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
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


def _hang_workload(rank, world, out_dir):
    import torch
    import torch.distributed as dist

    from lm_resiliency.scout.config import ReplayHarnessConfig
    from lm_resiliency.scout.instrument import trace_collectives
    from lm_resiliency.scout.monitor import OOBMonitor, ProgressBeacon

    entered_at = time.time()
    threading.Thread(target=_watchdog, args=(out_dir, rank), daemon=True).start()
    sub = dist.new_group([2, 3])                 # every rank creates it; only rank 2 uses it
    beacon = ProgressBeacon()
    trace_collectives(beacon)
    config = ReplayHarnessConfig(hang_stall_threshold_s=THRESHOLD_S, monitor_poll_interval_s=POLL_S)

    def on_report(report):
        _write_json(os.path.join(out_dir, f"report-{rank}.json"),
                    dict(report.to_json(), reported_at=time.time()))
        open(os.path.join(out_dir, "stop"), "w").close()
        os._exit(0)

    monitor = OOBMonitor(dist.distributed_c10d._get_default_store(), rank, world, config, beacon,
                         on_report=on_report, host=f"node{rank // 2}")
    monitor.start()
    x = torch.ones(4)
    for step in range(20):
        dist.all_reduce(x)
        beacon.progress(step)
        time.sleep(0.02)
    try:
        if rank == 2:
            _write_json(os.path.join(out_dir, "blocked.json"),
                        {"rank": rank, "at": time.time(), "entered_at": entered_at})
            dist.barrier(group=sub)              # rank 3 never joins: blocks forever
        else:
            dist.all_reduce(x)                   # rank 2 never joins: blocks forever
    except Exception:
        # Once the reporting rank exits, gloo may fail this rank's blocked collective before the
        # watchdog sees the stop file: that is the planned teardown, not a test failure.
        if os.path.exists(os.path.join(out_dir, "stop")):
            os._exit(0)
        raise
    return "not blocked"                         # unreachable unless the hang did not happen


def test_oob_monitor_names_the_rank_blocked_in_a_collective(tmp_path):
    out_dir = str(tmp_path)
    started = time.monotonic()
    outcomes = run_ranks(_hang_workload, 4, out_dir, timeout=HARNESS_TIMEOUT_S, check=False)
    elapsed = time.monotonic() - started

    # Every rank ended itself cleanly (the harness raises if any had to be killed).
    assert [(o.rank, o.exitcode, o.error) for o in outcomes] == [(r, 0, None) for r in range(4)], outcomes
    assert not any(name.startswith("watchdog") for name in os.listdir(out_dir))
    assert elapsed < WATCHDOG_S

    reports = sorted(name for name in os.listdir(out_dir) if name.startswith("report-"))
    assert reports == ["report-0.json"], reports  # exactly once, by the lowest healthy observer
    with open(os.path.join(out_dir, reports[0])) as f:
        report = json.load(f)
    with open(os.path.join(out_dir, "blocked.json")) as f:
        blocked_at = json.load(f)["at"]

    assert report["kind"] == "hang" and report["scope"] == "rank"
    assert report["ranks"] == [2] and report["hosts"] == ["node1"]
    assert report["resource"] == "barrier(group=[2,3])"
    evidence = report["evidence"]
    assert set(evidence["ranks"]) == {"0", "1", "2", "3"}
    assert {r: v["op"] for r, v in evidence["ranks"].items()} == {
        "0": "all_reduce", "1": "all_reduce", "2": "barrier(group=[2,3])", "3": "all_reduce"}
    assert report["step"] == 19 and report["confidence"] > 0.5

    latency = report["detected_at"] - blocked_at
    print(f"\nOOB hang detection latency: {latency:.2f}s (threshold {THRESHOLD_S}s, poll {POLL_S}s); "
          f"test wall {elapsed:.1f}s")
    assert 0.5 * THRESHOLD_S <= latency <= 2 * THRESHOLD_S, latency


def _healthy_workload(rank, world, seconds):
    import torch
    import torch.distributed as dist

    from lm_resiliency.scout.config import ReplayHarnessConfig
    from lm_resiliency.scout.instrument import trace_collectives
    from lm_resiliency.scout.monitor import THREAD_NAME_PREFIX, OOBMonitor, ProgressBeacon

    beacon = ProgressBeacon()
    trace = trace_collectives(beacon)
    config = ReplayHarnessConfig(hang_stall_threshold_s=THRESHOLD_S, monitor_poll_interval_s=POLL_S)
    reports = []
    monitor = OOBMonitor(dist.distributed_c10d._get_default_store(), rank, world, config, beacon,
                         on_report=reports.append)
    monitor.start()
    x = torch.ones(4)
    steps = 0
    deadline = time.monotonic() + seconds
    while True:
        dist.all_reduce(x)
        stop = torch.tensor([1.0 if time.monotonic() >= deadline else 0.0])
        dist.all_reduce(stop)                    # all ranks stop at the same step
        beacon.progress(steps)
        steps += 1
        if stop.item() > 0:
            break
        time.sleep(0.01)
    dist.barrier()
    time.sleep(3 * POLL_S)                       # let every monitor poll the final state
    dist.barrier()
    monitor.close()
    trace.remove()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]
    return {"reports": [r.to_json() for r in reports], "steps": steps, "leftover_threads": leftover,
            "collectives": beacon.snapshot()["collectives"]}


def test_healthy_job_produces_no_report():
    results = run_ranks(_healthy_workload, 4, 2 * THRESHOLD_S, timeout=HARNESS_TIMEOUT_S)
    for result in results:
        assert result["reports"] == []
        assert result["leftover_threads"] == []
        assert result["steps"] > 10 and result["collectives"] >= 2 * result["steps"]
