"""SCOUT's switches on 3 real gloo ranks: periodic replay off keeps the out-of-band hang monitor
and GEMINI; one check class off (the output check) stops exactly that check.

Replay off: a DDP loop with `enable_resiliency(interval=2, replay=ReplayHarnessConfig(
check_interval=0, ...))`; rank 1 stops before the forward of step 6 while ranks 0 and 2 wait in
DDP's all-reduce. The hang report must name rank 1, no replay check may have run, and GEMINI must
have captured steps 2 and 4. Ranks end themselves (the reporting rank writes a stop file that
every rank's watchdog obeys), as in test_scout_hang.py.
"""

import json
import os
import threading
import time

import pytest

from tests.distributed.test_scout_hang import WATCHDOG_S, _watchdog, _write_json
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

WORLD = 3
THRESHOLD_S = 2.0


def _replay_off_hang(rank, world, out_dir):
    import torch

    from lm_resiliency import InMemoryCkptConfig, ReplayHarnessConfig, enable_resiliency
    from tests.distributed.session_workloads import batch, build

    threading.Thread(target=_watchdog, args=(out_dir, rank), daemon=True).start()
    model, wrapped, features = build("ddp_forward", rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    checks = []

    def on_hang(report):
        _write_json(os.path.join(out_dir, f"report-{rank}.json"), report)
        open(os.path.join(out_dir, "stop"), "w").close()

    session = enable_resiliency(
        wrapped, optimizer, interval=2,
        checkpoint=InMemoryCkptConfig(run_id="switches", disk_folder=os.path.join(out_dir, "gemini"), timeout_s=60,
                                      host_memory="heap"),   # the ranks end without close(): nothing left in /dev/shm
        replay=ReplayHarnessConfig(check_interval=0, hang_stall_threshold_s=THRESHOLD_S, monitor_poll_interval_s=0.2),
        fault_callback=checks.append, oob_fault_callback=on_hang)
    for step in range(5):
        wrapped(batch(step, rank, features)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    wrapped(batch(5, rank, features))   # completes the pending capture of step 4
    session.manager.maybe_wait()
    _write_json(os.path.join(out_dir, f"state-{rank}.json"), {
        "check_interval": session.replay_config.check_interval, "capture_interval": session.config.interval,
        "detector": session.scout.detector is not None, "ledger": session.ledger is not None,
        "monitor": session.scout.monitor is not None, "fault_callbacks": len(checks),
        "last_replay_result": session.last_replay_result is not None, "latest": session.manager.latest_step})
    if rank == 1:
        time.sleep(WATCHDOG_S)          # stuck outside any collective: a dead kernel, a deadlock
    optimizer.zero_grad()
    wrapped(batch(5, rank, features)).pow(2).mean().backward()   # waits for rank 1 in the all-reduce
    time.sleep(WATCHDOG_S)


def test_periodic_replay_off_keeps_the_hang_monitor_and_gemini(tmp_path):
    run_ranks(_replay_off_hang, WORLD, str(tmp_path), timeout=150, check=False)
    states = [json.loads((tmp_path / f"state-{rank}.json").read_text()) for rank in range(WORLD)]
    assert states == [{"check_interval": 0, "capture_interval": 2, "detector": False, "ledger": False,
                       "monitor": True, "fault_callbacks": 0, "last_replay_result": False, "latest": 4}] * WORLD
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("report-*.json"))]
    assert len(reports) == 1, reports
    assert (reports[0]["kind"], reports[0]["scope"], reports[0]["ranks"]) == ("hang", "rank", [1]), reports[0]


def _output_switch(rank, world):
    from lm_resiliency.scout.config import ReplayHarnessConfig
    from tests.distributed.scout_workloads import train

    seen = {}
    for name, config in (("output_off", ReplayHarnessConfig(check_interval=1, output_check_interval=0)),
                         ("output_on", ReplayHarnessConfig(check_interval=1))):
        results = train(rank, world, config, 3, fault="sign_flip", fault_rank=1, fault_path="head")
        seen[name] = {step: sorted({(c.check, c.module_path, c.verdict, c.faulty) for c in r.checks})
                      for step, r in results.items()}
    return seen


def test_output_check_interval_zero_turns_off_only_the_output_check():
    for rank, seen in enumerate(run_ranks(_output_switch, WORLD, timeout=200)):
        off, on = seen["output_off"], seen["output_on"]
        assert sorted(off) == sorted(on) == [1, 2, 3], rank
        for step in (1, 2, 3):
            assert {c[0] for c in off[step]} >= {"embedding", "hidden", "optimizer"}, (rank, off[step])
            assert all(c[1] != "head" for c in off[step]) and all(c[2] == "clean" for c in off[step]), off[step]
            # The same fault with the output check on: SCOUT names rank 1 at the head.
            assert ("output", "head", "sdc", (1,)) in on[step], (rank, on[step])
