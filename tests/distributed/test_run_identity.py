"""Run identity: placeholder ids are no identity, the attach warning when a relaunch cannot find
this launch's state, and the one resume/fresh line on rank 0 (gloo processes, subprocesses and a
real torchrun)."""

import logging
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from tests.distributed.gemini_workloads import train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelname, record.getMessage()))


def _job(rank, world, tmp):
    """Train 4 steps with a disk flush every 2 (state a relaunch of the same run would resume from),
    after looking for state to resume. Returns (run id, step found, identity log records)."""
    records = _Records()
    logging.getLogger("lm_resiliency.gemini.identity").addHandler(records)
    config = InMemoryCkptConfig(interval=2, replication_jump=1, disk_flush_interval=2, host_memory="heap",
                                disk_folder=os.path.join(tmp, "disk"), timeout_s=60)
    manager = InMemoryCheckpointManager(config)
    found = manager.find_latest()
    train(rank, 4, config, save_every=2, manager=manager)
    manager.flush_now()
    manager.close()
    return manager.run_id, found, records.messages


def test_torchelastic_placeholder_none_is_not_an_identity(tmp_path):
    # torchrun --master-port=... without --rdzv-id exports TORCHELASTIC_RUN_ID=none: two unrelated
    # jobs with the same disk folder must not share state under it.
    env = {"TORCHELASTIC_RUN_ID": "none"}
    first = run_ranks(_job, 2, str(tmp_path), env=env, timeout=90)
    second = run_ranks(_job, 2, str(tmp_path), env=env, timeout=90)
    for job in (first, second):
        assert len({run_id for run_id, _, _ in job}) == 1 and job[0][0] != "none"
        assert [found for _, found, _ in job] == [None, None]  # never the other job's step 4
    assert first[0][0] != second[0][0]
    warnings = [m for level, m in first[0][2] if level == "WARNING"]
    assert any("ignoring placeholder run id TORCHELASTIC_RUN_ID='none'" in m for m in warnings), warnings
    assert any("no run id is set" in m and "LM_RESILIENCY_RUN_ID" in m and "--rdzv-id" in m for m in warnings)
    assert first[1][2] == []  # rank 0 only


def _identity_only(rank, world, tmp):
    records = _Records()
    logging.getLogger("lm_resiliency.gemini.identity").addHandler(records)
    manager = InMemoryCheckpointManager(InMemoryCkptConfig(disk_folder=tmp, host_memory="heap", replication_jump=1))
    manager.close()
    return manager.identity.run_id, manager.identity.stable, records.messages


def test_standalone_torchrun_id_is_used_but_warned_about(tmp_path):
    # torchrun --standalone draws str(uuid4()) per launch: right for its own restarts, lost by a relaunch.
    launch_id = str(uuid.uuid4())
    results = run_ranks(_identity_only, 2, str(tmp_path), env={"TORCHELASTIC_RUN_ID": launch_id}, timeout=60)
    assert [(run_id, stable) for run_id, stable, _ in results] == [(launch_id, False)] * 2
    assert any("draws anew for every launch" in m for _, m in results[0][2])
    # A real --rdzv-id is a stable identity, and LM_RESILIENCY_RUN_ID comes first: no warning.
    for env, expected in (({"TORCHELASTIC_RUN_ID": "slurm-1234"}, "slurm-1234"),
                          ({"LM_RESILIENCY_RUN_ID": "job-42", "TORCHELASTIC_RUN_ID": launch_id}, "job-42")):
        results = run_ranks(_identity_only, 2, str(tmp_path), env=env, timeout=60)
        assert [(run_id, stable) for run_id, stable, _ in results] == [(expected, True)] * 2
        assert not any(level == "WARNING" for level, _ in results[0][2])


# ------------------------------------------------------------------ the resume line, default logging

_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    out, steps, kill_rank, kill_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    model = DDP(model) if distributed else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    resiliency = enable_resiliency(model, optimizer, interval=2, enable_detection=False, checkpoint=InMemoryCkptConfig(
        disk_folder=os.path.join(out, "gemini"), shared_memory_dir=os.path.join(out, "shm"),
        disk_flush_interval=2, timeout_s=60))
    print(f"rank {rank} start step {resiliency.step_count}", flush=True)
    for step in range(resiliency.step_count, steps):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == kill_rank and step + 1 == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    resiliency.close()
    if distributed:
        dist.destroy_process_group()
""")


def _script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(_SCRIPT)
    return str(path)


def _env(**updates):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LM_RESILIENCY", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **updates)
    return env


def test_resume_line_shows_with_default_logging(tmp_path):
    script, out = _script(tmp_path), str(tmp_path / "out")
    env = _env(LM_RESILIENCY_RUN_ID="single-job")
    first = subprocess.run([sys.executable, script, out, "4", "-1", "0"], capture_output=True, text=True,
                           timeout=120, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "lm-resiliency: started fresh: no GEMINI state of run 'single-job' (from LM_RESILIENCY_RUN_ID)" \
        in first.stderr
    second = subprocess.run([sys.executable, script, out, "6", "-1", "0"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "rank 0 start step 4" in second.stdout
    assert "lm-resiliency: resumed run 'single-job' at step 4 from disk (pytorch" in second.stderr, second.stderr


@pytest.mark.timeout(400)
def test_torchrun_standalone_warns_then_resumes_with_a_run_id(tmp_path):
    script, out = _script(tmp_path), str(tmp_path / "out")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]

    plain = subprocess.run(torchrun + [script, str(tmp_path / "plain"), "2", "-1", "0"], capture_output=True,
                           text=True, timeout=180, env=_env())
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "draws anew for every launch" in plain.stderr and "torchrun --rdzv-id" in plain.stderr
    assert plain.stderr.count("draws anew for every launch") == 1  # rank 0 only

    env = _env(LM_RESILIENCY_RUN_ID="torchrun-job")
    killed = subprocess.run(torchrun + [script, out, "8", "1", "5"], capture_output=True, text=True, timeout=180,
                            env=env)
    assert killed.returncode != 0, killed.stderr[-3000:]
    resumed = subprocess.run(torchrun + [script, out, "8", "-1", "0"], capture_output=True, text=True, timeout=180,
                             env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "rank 0 start step 4" in resumed.stdout and "rank 1 start step 4" in resumed.stdout
    assert "lm-resiliency: resumed run 'torchrun-job' at step 4 from " in resumed.stderr, resumed.stderr[-3000:]
    assert resumed.stderr.count("lm-resiliency: resumed run") == 1  # rank 0 only


def test_relative_disk_folder_is_resolved_once_at_attach(tmp_path, monkeypatch, caplog):
    (tmp_path / "launch").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "launch")
    with caplog.at_level(logging.INFO, logger="lm_resiliency.gemini.manager"):
        manager = InMemoryCheckpointManager(InMemoryCkptConfig(run_id="relative", disk_folder="checkpoints",
                                                               host_memory="heap", disk_flush_interval=1))
    folder = str(tmp_path / "launch" / "checkpoints")
    assert manager.config.disk_folder == folder and f"keeps node-local state under {folder}" in caplog.text
    monkeypatch.chdir(tmp_path / "elsewhere")  # a chdir after attach does not move the node-local tier
    manager.save({"w": torch.ones(4)}, 1)
    manager.maybe_wait()
    manager.flush_now()
    manager.close()
    assert os.listdir(tmp_path / "elsewhere") == [] and manager.store.directory.startswith(folder)
    assert any(name.endswith(".gemini") for name in os.listdir(manager.store.directory))
