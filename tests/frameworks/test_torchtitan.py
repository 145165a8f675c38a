"""lm-resiliency with TorchTitan's real Trainer (llama3 debug model, FSDP2 over 2 gloo ranks).

TorchTitan trains on CPU only with the test-only patches of tests/frameworks/torchtitan_cpu.py
(none touches lm-resiliency). The debug model takes seconds per step on a loaded CPU, so the
kill-and-resume campaign is marked slow.
"""

import os
import signal
import socket

import pytest

pytest.importorskip("torchtitan")

from tests.distributed.gemini_workloads import assert_same
from tests.harness import run_ranks


def _env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.mark.timeout(600)
def test_cli_opt_in_counts_steps_captures_and_refuses_misuse(tmp_path):
    """`--module lm_resiliency.integrations.torchtitan` on one rank: session.step_count follows
    trainer.step, GEMINI captured step 2 of 3, a separate optimizer is refused at attach, a durable load
    after training started is refused, and trainer.close() removes the hooks."""
    from tests.frameworks.torchtitan_workloads import one_rank_checks

    [out] = run_ranks(one_rank_checks, 1, str(tmp_path), timeout=500, init=False, env=_env())
    assert "owns its optimizers" in out["optimizer_refused"]
    assert out["step_count"] == out["trainer_step"] == 3
    assert out["latest"] == 2  # interval 2; the capture completes in step 3's forward
    assert "already ran 3 step(s)" in out["late_load_refused"]
    assert out["hooks_removed"]


@pytest.mark.timeout(600)
def test_each_capture_holds_the_data_position_of_its_own_step_boundary(tmp_path):
    """GEMINI completes a capture in the next step's forward, after TorchTitan fetched the next batch;
    its text dataset's `state_dict()` returns the live token buffers that fetch extends in place. Each
    capture must still hold exactly the position TorchTitan's own checkpoint saves at that boundary."""
    from tests.frameworks.torchtitan_workloads import captured_data_positions

    # Every step captured (interval 1); the boundaries of steps 3 and 5 are ones where the next fetch
    # extends the buffers in place (this data, one rank).
    [out] = run_ranks(captured_data_positions, 1, str(tmp_path), 6, 1, timeout=500, init=False, env=_env())
    assert sorted(out["gemini"]) == [1, 2, 3, 4, 5]
    for step, position in out["gemini"].items():
        assert position == out["titan"][step], f"the capture of step {step} holds another data position"


@pytest.mark.slow  # four 2-rank TorchTitan launches: ~9 minutes on 2 loaded cores
@pytest.mark.timeout(2400)
def test_cli_opt_in_sigkill_resumes_bitwise_equal_and_newer_durable_load_is_refused(tmp_path):
    """Switched on by `--module lm_resiliency.integrations.torchtitan` alone: SIGKILL at step 6,
    relaunch resumes from GEMINI step 4 and ends bitwise equal (model shards, Adam moments, LR,
    counters) to an uninterrupted run without lm-resiliency. In between, a launch whose TorchTitan
    checkpoint folder holds a newer step (6) than GEMINI (4) is refused before training."""
    from tests.frameworks.torchtitan_workloads import durable_conflict, kill_then_resume

    folder, base = str(tmp_path / "run"), str(tmp_path / "base")
    killed = run_ranks(kill_then_resume, 2, folder, "kill", timeout=900, init=False, env=_env(), check=False)
    assert [o.killed_by for o in killed] == [signal.SIGKILL] * 2, [o.error for o in killed]
    baseline = run_ranks(kill_then_resume, 2, base, "baseline", timeout=900, init=False, env=_env())
    refused = run_ranks(durable_conflict, 2, folder, os.path.join(base, "dump"), timeout=900, init=False,
                        env=_env())
    for message in refused:
        assert "refused" in message and "GEMINI step 4" in message and "step 6" in message, message
    resumed = run_ranks(kill_then_resume, 2, folder, "resume", timeout=900, init=False, env=_env())
    for rank in range(2):
        assert resumed[rank]["recovered_from"] == "gemini"
        assert resumed[rank]["first_step"] == 5, f"rank {rank} resumed at step {resumed[rank]['first_step']}"
        assert resumed[rank]["state"]["step"] == baseline[rank]["state"]["step"] == 6
        assert_same(resumed[rank]["state"], baseline[rank]["state"], f"rank {rank}")


@pytest.mark.slow  # three 4-rank TorchTitan launches: 10-16 minutes on 2 loaded cores
@pytest.mark.timeout(3000)
def test_dp2_tp2_sigkill_resumes_bitwise_equal_with_scout_on(tmp_path):
    """DP 2 x TP 2 (FSDP2 over dp_shard, TorchTitan's TP plan) on 4 gloo ranks, lm-resiliency and SCOUT
    switched on from the command line: SIGKILL at step 6, the relaunch resumes from GEMINI step 4 and
    ends bitwise equal to an uninterrupted run without lm-resiliency; SCOUT replays among the
    data-parallel ranks of one TP coordinate, and its check at step 6 blames no rank."""
    from tests.frameworks.torchtitan_workloads import kill_then_resume

    folder, base = str(tmp_path / "run"), str(tmp_path / "base")
    killed = run_ranks(kill_then_resume, 4, folder, "kill", 2, True, timeout=1200, init=False, env=_env(),
                       check=False)
    assert [o.killed_by for o in killed] == [signal.SIGKILL] * 4, [o.error for o in killed]
    resumed = run_ranks(kill_then_resume, 4, folder, "resume", 2, True, timeout=1200, init=False, env=_env())
    baseline = run_ranks(kill_then_resume, 4, base, "baseline", 2, timeout=1200, init=False, env=_env())
    for rank in range(4):
        assert resumed[rank]["recovered_from"] == "gemini"
        assert resumed[rank]["first_step"] == 5, f"rank {rank} resumed at step {resumed[rank]['first_step']}"
        assert resumed[rank]["peers"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        verdicts = resumed[rank]["verdicts"]
        assert resumed[rank]["check_step"] == 6 and verdicts["embedding"][1] == "clean", verdicts
        # A TP leaf linear (the output check's rotation) fails to replay alone: its parent's TP hook
        # turns its input into a DTensor. That is "error" (no evidence), never a verdict on a rank.
        assert all(v == "clean" or (v == "error" and check == "output") for check, (_, v) in verdicts.items()), \
            verdicts
        assert resumed[rank]["state"]["step"] == baseline[rank]["state"]["step"] == 6
        assert_same(resumed[rank]["state"], baseline[rank]["state"], f"rank {rank}")
