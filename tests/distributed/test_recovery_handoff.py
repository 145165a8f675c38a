"""The recovery handoff on 3 real DDP ranks: SCOUT finds SDC, the manager receives JSON-ready
payloads, and the relaunch passes `prepare_recovery(...)`'s result as `recovery_mode=`.

Rank 1 computes wrong first-layer outputs from step 7 on; the check at step 8 localizes it. Every rank
relays what orchestration receives with `json.dumps` (a manager forwarding to a control plane),
calls `prepare_recovery("sdc")`, and the job is killed. The relaunch with that mode resumes from
the RECOVERY_VERIFIED step 6 and ends bitwise equal to a run that never had the fault."""

import json
import signal

import pytest

from lm_resiliency import RecoveryMode
from tests.distributed.gemini_workloads import assert_same
from tests.distributed.handoff_workloads import train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(420)

WORLD, STEPS = 3, 10


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_sdc_decision_and_report_reach_the_manager_as_json_and_the_relaunch_uses_the_mode(tmp_path):
    baseline = run_ranks(train, WORLD, str(tmp_path / "clean"), STEPS, timeout=200)
    folder = tmp_path / "managed"
    folder.mkdir()
    killed = run_ranks(train, WORLD, str(folder), STEPS, None, 7, 8, timeout=200, check=False)
    assert [o.killed_by for o in killed] == [signal.SIGKILL] * WORLD, [o.error for o in killed]

    modes = []
    for rank in range(WORLD):
        with open(folder / f"mode-{rank}.json") as f:
            modes.append(json.load(f))
        sent = _lines(folder / f"control-plane-{rank}.jsonl")
        # The replay check's decision, its fault reports (one per check that saw it), then
        # prepare_recovery's decision.
        kinds = [next(iter(m)) for m in sent]
        assert kinds[0] == kinds[-1] == "recovery" and set(kinds[1:-1]) == {"fault"}, (rank, sent)
        automatic, faults, prepared = sent[0]["recovery"], [m["fault"] for m in sent[1:-1]], sent[-1]["recovery"]
        assert (automatic["failure"], automatic["mode"], automatic["step"], automatic["available"]) == (
            "sdc", "recovery_verified", 6, True), automatic
        assert automatic["ranks"] == [rank]
        for fault in faults:
            assert (fault["kind"], fault["scope"], fault["ranks"], fault["step"]) == ("sdc", "rank", [1], 8), fault
        assert "hidden:layers.0" in [fault["resource"] for fault in faults], faults
        assert (prepared["failure"], prepared["mode"], prepared["step"]) == ("sdc", "recovery_verified", 6)
    assert modes == [RecoveryMode.RECOVERY_VERIFIED.value] * WORLD

    resumed = run_ranks(train, WORLD, str(folder), STEPS, modes[0], timeout=200)
    for rank in range(WORLD):
        assert resumed[rank][0] == 6, rank
        assert_same(resumed[rank][1], baseline[rank][1], f"rank {rank}")
