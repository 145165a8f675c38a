"""`lm-resiliency inspect` on a disk folder holding two runs of two topologies (3 and 2 DDP ranks,
real gloo processes), checked against what `enable_resiliency` then does on a relaunch, and the
two "started fresh" hints: the same run relaunched on another number of ranks, and a relaunch
without a run id next to another run's state."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(600)


def _train(rank: int, world: int, base: str, run_id, steps: int, detection: bool):
    """DDP on `world` ranks under enable_resiliency; returns (step resumed at, rank 0's warnings)."""
    import torch
    from torch import nn

    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("lm_resiliency").addHandler(handler)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = InMemoryCkptConfig(run_id=run_id, disk_folder=os.path.join(base, "disk"), disk_flush_interval=2,
                                shared_memory_dir=os.path.join(base, "shm"), timeout_s=60.0)
    resiliency = enable_resiliency(model, optimizer, interval=2, checkpoint=config, enable_detection=detection)
    resumed = resiliency.step_count
    for step in range(resumed, steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    resiliency.close()
    return resumed, [m for m in seen if m.startswith("lm-resiliency: started fresh")]


def _inspect(base: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lm_resiliency", "inspect", os.path.join(base, "disk"),
                           "--shared-memory-dir", os.path.join(base, "shm"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


CLEAN = {"LM_RESILIENCY_RUN_ID": "", "TORCHELASTIC_RUN_ID": ""}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """ws3: 3 ranks with SCOUT (RECOVERY_VERIFIED steps), captures 2 and 4 flushed; ws2: 2 ranks,
    capture 2 flushed. Each test works on its own copy."""
    base = str(tmp_path_factory.mktemp("two-runs"))
    assert [r[0] for r in run_ranks(_train, 3, base, "ws3", 5, True, timeout=300, env=CLEAN)] == [0, 0, 0]
    assert [r[0] for r in run_ranks(_train, 2, base, "ws2", 3, False, timeout=300, env=CLEAN)] == [0, 0]
    return base


def _copy(source: str, target) -> str:
    shutil.copytree(os.path.join(source, "disk"), os.path.join(target, "disk"))
    return str(target)


def test_inspect_names_both_runs_and_the_relaunch_resumes_where_it_says(two_runs, tmp_path):
    base = _copy(two_runs, tmp_path)
    # Step 4 of rank 2 is lost: its own shard and the replica rank 0 holds. Step 2 is the newest left.
    [ws3_dir] = [os.path.join(base, "disk", n) for n in os.listdir(os.path.join(base, "disk"))
                 if os.path.exists(os.path.join(base, "disk", n, "rank-00002"))]
    os.remove(os.path.join(ws3_dir, "rank-00002", "own-000000000004.gemini"))
    os.remove(os.path.join(ws3_dir, "rank-00000", "peer-00002-000000000004.gemini"))

    listed = _inspect(base)
    assert listed.returncode == 0, listed.stderr
    assert "run 'ws3': 3 ranks, pytorch/ddp" in listed.stdout and "run 'ws2': 2 ranks, pytorch/ddp" in listed.stdout
    doc = json.loads(_inspect(base, "--json").stdout)
    runs = {run["run_id"]: run for run in doc["runs"]}
    assert sorted(runs) == ["ws2", "ws3"]
    assert (runs["ws3"]["world_size"], runs["ws2"]["world_size"]) == (3, 2)
    assert runs["ws3"]["topology"] != runs["ws2"]["topology"]
    ws3 = {r["rank"]: r for r in runs["ws3"]["ranks"]}
    assert [(ws3[r]["newest_complete_step"], ws3[r]["recovery_verified_step"]) for r in range(3)] == [
        (4, 4), (4, 4), (2, 4)]
    assert [r["newest_complete_step"] for r in runs["ws2"]["ranks"]] == [2, 2]
    assert runs["ws3"]["resume"]["step"] == 2 and runs["ws2"]["resume"]["step"] == 2, (
        runs["ws3"]["resume"], runs["ws2"]["resume"])
    assert runs["ws3"]["resume"]["newer"] == [{"step": 4, "why_not": "no copy of rank 2's state at this step "
                                                                     "(neither its own nor its peer's replica)"}]

    relaunch = _inspect(base, "--run-id", "ws3", "--world-size", "3")
    assert relaunch.returncode == 0, relaunch.stdout
    assert "a relaunch of run 'ws3' on 3 ranks resumes at step 2: the newest step every rank can load" in relaunch.stdout
    assert "not step 4: no copy of rank 2's state" in relaunch.stdout
    other = _inspect(base, "--run-id", "ws3", "--world-size", "2")
    assert other.returncode == 1
    assert "starts fresh: state of run 'ws3' exists only for another topology: 3 ranks" in other.stdout

    # What enable_resiliency then does: the step inspect named.
    assert [r[0] for r in run_ranks(_train, 3, base, "ws3", 2, True, timeout=300, env=CLEAN)] == [2, 2, 2]


def test_a_fresh_start_names_the_state_it_could_not_use(two_runs, tmp_path):
    base = _copy(two_runs, tmp_path)
    # The same run on 2 ranks cannot load the 3-rank state, and says so.
    resumed, fresh = run_ranks(_train, 2, base, "ws3", 0, False, timeout=300, env=CLEAN)[0]
    assert resumed == 0 and len(fresh) == 1
    assert "state of run 'ws3' exists for another topology (3 ranks, step 4) and cannot be loaded by 2 ranks" in fresh[0]
    # A relaunch without a run id finds only a new one: it names the run it could resume.
    resumed, fresh = run_ranks(_train, 2, base, None, 0, False, timeout=300, env=CLEAN)[0]
    assert resumed == 0 and len(fresh) == 1
    assert "this folder holds run 'ws2''s state (newest step 2); pass run_id='ws2' to resume it" in fresh[0]
