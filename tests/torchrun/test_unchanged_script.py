"""A script shaped like pytorch/examples' DDP tutorial (tests/torchrun/tutorial_ddp.py: its own
snapshot resume at start, epochs over a DataLoader with a DistributedSampler, no lm_resiliency
import) under `--rdzv-backend=lm_resiliency`, 3 CPU workers, one SIGKILLed mid-epoch: unchanged,
it stops with the message instead of resuming its snapshot on top of GEMINI's step; with the one
loop edit it ends bitwise equal to the uninterrupted run. The event log next to the state holds
every restart, and `lm-resiliency timeline` draws the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.torchrun import launcher as L

MODULE = "tests.torchrun.tutorial_ddp"
EPOCHS = "6"  # 4 optimizer steps per epoch on each of 3 ranks: 24 steps
KILL = ["1", "11"]  # rank 1 dies after step 11 (epoch 2, batch 3); the newest capture is step 10

pytestmark = pytest.mark.timeout(900)


def _policy(base: str) -> str:
    text = L.POLICY.format(disk=os.path.join(base, "disk")).replace(
        "[checkpoint]", f"[checkpoint]\nshared_memory_dir = \"{os.path.join(base, 'shm')}\"")
    return L.write_policy(base, text)


def _run(base: str, name: str, args, max_restarts: int = 0):
    out = os.path.join(base, name)
    os.makedirs(out)
    run_id = f"ux-tutorial-{name}-{uuid.uuid4().hex[:8]}"
    command = L.agent_command(run_id=run_id, endpoint=os.path.join(base, f"rdzv-{name}"),
                              context=os.path.join(base, f"ctx-{name}", "context.json"), policy=_policy(base),
                              nnodes="1:1", nproc=3, max_restarts=max_restarts, module=MODULE,
                              args=[out, os.path.join(out, "snapshot.pt"), EPOCHS, *args])
    env = L.agent_env(base, L.machine_id_file(base, name))
    return L.run_agent(command, env, 400, os.path.join(base, f"agent-{name}.log")), out


def _final(out: str) -> dict:
    names = [n for n in os.listdir(out) if n.startswith("final-")]
    assert len(names) == 1, names
    with open(os.path.join(out, names[0])) as f:
        return json.load(f)


@pytest.mark.slow  # three torchrun runs of 3 workers, two with a restart (a few minutes on 2 busy cores)
def test_the_tutorial_script_stops_with_the_message_unchanged_and_ends_exact_with_the_one_edit(tmp_path):
    base = str(tmp_path)
    unchanged, unchanged_out = _run(base, "unchanged", KILL, max_restarts=1)
    assert unchanged.returncode != 0, unchanged.stdout[-6000:]
    log = unchanged.stdout
    assert "Resuming training from snapshot at Epoch 1" in log  # the script's own resume ran...
    assert ("generation 1 (same-node restart) resumes run" in log
            and "at GEMINI step 10: the training loop must start at step 10" in log)
    # ... and lm-resiliency refused to recover GEMINI's step 10 on top of it, on every rank.
    assert "not attaching: this generation resumes run" in log and "at GEMINI step 10" in log
    assert "Linear.load_state_dict() ran before the attach; ranks 0, 1, 2" in log
    assert "without reading LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP" in log
    assert not [n for n in os.listdir(unchanged_out) if n.startswith("final-")]  # never silently finished
    # The survivors of the kill (a gloo error, or torchrun's SIGTERM) say what they kept for the restart.
    assert "; its newest capture, step 10, is written to " in log and "for the restart" in log

    edited, edited_out = _run(base, "edited", ["edited", *KILL], max_restarts=1)
    assert edited.returncode == 0, edited.stdout[-6000:]
    clean, clean_out = _run(base, "clean", ["edited"])
    assert clean.returncode == 0, clean.stdout[-6000:]
    resumed, baseline = _final(edited_out), _final(clean_out)
    assert (resumed["start"], resumed["steps"]) == (10, 14) and (baseline["start"], baseline["steps"]) == (0, 24)
    assert resumed["tensors"] == baseline["tensors"] and len(baseline["tensors"]) == 2

    # The event log next to the state holds both generations of every rank; timeline draws them.
    from lm_resiliency.events import read_events

    [namespace] = [n for n in os.listdir(os.path.join(base, "disk"))
                   if any(e["event"] == "start" and e["run_id"].startswith("ux-tutorial-edited")
                          for e in read_events(os.path.join(base, "disk", n, "rank-00000")).events)]
    run_dir = os.path.join(base, "disk", namespace)
    for rank in range(3):
        events = read_events(os.path.join(run_dir, f"rank-{rank:05d}")).events
        starts = [e for e in events if e["event"] == "start"]
        assert [e["restart"] for e in starts] == ["0", "1"], events
        recovered = [e for e in events if e["event"] == "recovered"]
        assert [(e["step"], e["source"]) for e in recovered] == [(10, "gemini")]
    picture = os.path.join(base, "timeline.png")
    done = subprocess.run([sys.executable, "-m", "lm_resiliency", "timeline", run_dir, "--out", picture, "--json"],
                          capture_output=True, text=True, timeout=120, cwd=L.ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert [(g["index"], g["resumed_step"]) for g in doc["generations"]] == [(0, 0), (1, 10)]
    assert doc["picture"] == picture and os.path.getsize(picture) > 10000
