"""TorchTitan's real Trainer under torchrun, one rank SIGKILLed inside an optimizer step, the whole
command launched again: the relaunch resumes from GEMINI's in-memory step and ends bitwise equal to
the same trainer run uninterrupted without lm-resiliency (tests/frameworks/torchtitan_relaunch.py).

Each launch is a fresh `torchrun --standalone`: torchrun's in-place restart of a `--standalone`
generation hangs on gloo (docs: CPU-FRAMEWORKS), and relaunching the command is how a scheduler
restarts a failed job anyway.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("torchtitan")

import torch

from tests.distributed.gemini_workloads import assert_same
from tests.torchrun.launcher import ROOT, run_agent

STEPS, KILL_STEP = 14, 11


def _launch(folder: str, phase: str, timeout: float) -> tuple:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=0", "--monitor-interval=0.5", "--module", "tests.frameworks.torchtitan_relaunch",
               "--folder", folder, "--phase", phase, "--steps", str(STEPS), "--kill-step", str(KILL_STEP)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LM_RESILIENCY", "TORCHELASTIC"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return run_agent(command, env, timeout, os.path.join(folder, f"{phase}.log"))


def _journal(folder: str, phase: str, rank: int) -> dict:
    with open(os.path.join(folder, f"{phase}-{rank}.losses")) as f:
        return {str(step): loss for step, loss in (json.loads(line) for line in f)}


def _outputs(folder: str, phase: str, rank: int) -> tuple:
    with open(os.path.join(folder, f"{phase}-{rank}.json")) as f:
        summary = json.load(f)
    return summary, torch.load(os.path.join(folder, f"{phase}-{rank}.pt"), weights_only=True)


@pytest.mark.slow  # three 2-rank TorchTitan launches of 14 steps: a few minutes on 2 loaded cores
@pytest.mark.timeout(2400)
def test_rank_killed_inside_optimizer_step_relaunch_resumes_bitwise_equal_to_plain(tmp_path):
    folder = str(tmp_path)
    killed = _launch(folder, "kill", 900)
    assert killed.returncode != 0, killed.stdout
    assert "Signals.SIGKILL" in killed.stdout or "exitcode  : -9" in killed.stdout, killed.stdout[-4000:]
    assert not os.path.exists(os.path.join(folder, "kill-0.pt"))
    resumed = _launch(folder, "resume", 900)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    plain = _launch(folder, "plain", 900)
    assert plain.returncode == 0, plain.stdout[-6000:]
    for rank in range(2):
        summary, state = _outputs(folder, "resume", rank)
        baseline_summary, baseline = _outputs(folder, "plain", rank)
        # The killed run trained exactly as the plain one up to the kill (same seed, same data).
        before_kill = _journal(folder, "kill", rank)
        assert sorted(before_kill, key=int) == [str(s) for s in range(1, KILL_STEP)]
        assert before_kill == {s: baseline_summary["losses"][s] for s in before_kill}
        # Step 10 was GEMINI's newest complete capture; step 11 never completed on rank 1.
        assert (summary["recovered_from"], summary["first_step"]) == ("gemini", KILL_STEP)
        assert state["step"] == baseline["step"] == STEPS
        resumed_losses = summary["losses"]
        assert sorted(resumed_losses, key=int) == [str(s) for s in range(KILL_STEP, STEPS + 1)]
        assert resumed_losses == {s: baseline_summary["losses"][s] for s in resumed_losses}, \
            (resumed_losses, baseline_summary["losses"])
        assert_same(state, baseline, f"rank {rank}")
