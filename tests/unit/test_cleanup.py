"""python -m lm_resiliency.cleanup: removes dead runs' shared-memory slots and node-local folders
older than the bound, lists them, and never touches a live process's state."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.cleanup import main, parse_age
from lm_resiliency.experimental import InMemoryCheckpointManager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Two runs that saved and flushed step 1, then their process was SIGKILLed.
_CRASH = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.experimental import InMemoryCheckpointManager

    tmp, dirs = sys.argv[1], {}
    for run_id in ("old-run", "young-run"):
        manager = InMemoryCheckpointManager(InMemoryCkptConfig(
            run_id=run_id, interval=1, disk_flush_interval=1, disk_folder=os.path.join(tmp, "disk"),
            shared_memory_dir=os.path.join(tmp, "shm")))
        manager.save({"w": torch.arange(1000.0)}, 1)
        manager.maybe_wait()
        manager.flush_now()
        dirs[run_id] = [os.path.dirname(manager.host_memory().directory), os.path.dirname(manager.store.directory)]
    print(json.dumps(dirs), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _backdate(path, seconds):
    when = time.time() - seconds
    for parent, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                os.utime(os.path.join(parent, name), (when, when), follow_symlinks=False)
            except FileNotFoundError:  # a temporary file renamed meanwhile
                pass
    os.utime(path, (when, when))


def _tree(path):
    return sorted(os.path.relpath(os.path.join(p, n), path) for p, ds, fs in os.walk(path) for n in fs + ds)


@pytest.fixture
def crashed_runs(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(_CRASH)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert done.returncode == -9, done.stderr[-3000:]
    dirs = json.loads(done.stdout.strip().splitlines()[-1])
    # A live run of this process (started before the old run looks old: it would reap it).
    live = InMemoryCheckpointManager(InMemoryCkptConfig(
        run_id="live-run", interval=1, disk_flush_interval=1, disk_folder=str(tmp_path / "disk"),
        shared_memory_dir=str(tmp_path / "shm")))
    live.save({"w": torch.ones(10)}, 1)
    live.maybe_wait()
    live.flush_now()
    live._drain()  # the background flush of step 1 too: nothing changes the trees after this
    dirs["live-run"] = [os.path.dirname(live.host_memory().directory), os.path.dirname(live.store.directory)]
    for path in dirs["live-run"] + dirs["old-run"]:
        _backdate(path, 2 * 24 * 3600)  # last written two days ago
    yield dict(dirs, **{"live-manager": live})
    live.close()


def _args(tmp_path, *extra):
    return ["--shared-memory-dir", str(tmp_path / "shm"), "--disk-folder", str(tmp_path / "disk"), *extra]


def test_dry_run_lists_and_removes_nothing(tmp_path, crashed_runs):
    before = _tree(tmp_path / "shm"), _tree(tmp_path / "disk")
    done = subprocess.run([sys.executable, "-m", "lm_resiliency.cleanup", *_args(tmp_path, "--dry-run")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    (old_shm, old_disk), (young_shm, young_disk) = crashed_runs["old-run"], crashed_runs["young-run"]
    removed = [line for line in done.stdout.splitlines() if line.startswith("would remove: ")]
    assert len(removed) == 2 and any(old_disk + " (disk" in line for line in removed)
    assert any(line.startswith(f"would remove: {old_shm}/rank-00000.") and "dead process" in line for line in removed)
    assert f"kept: {young_disk} (disk; last written" in done.stdout
    assert f"kept: {young_shm}/rank-00000." in done.stdout
    assert "live process" in done.stdout and f"kept: {crashed_runs['live-run'][1]}" in done.stdout
    assert (_tree(tmp_path / "shm"), _tree(tmp_path / "disk")) == before


def test_removes_dead_runs_older_than_the_bound_never_live_ones(tmp_path, crashed_runs, capsys):
    (old_shm, old_disk), (young_shm, young_disk) = crashed_runs["old-run"], crashed_runs["young-run"]
    live_shm, live_disk = crashed_runs["live-run"]
    assert main(_args(tmp_path)) == 0  # default --older-than 24h
    assert "removed 2 director(ies)" in capsys.readouterr().out
    assert not os.path.exists(old_shm) and not os.path.exists(old_disk)
    assert os.listdir(young_shm) and os.listdir(young_disk) and os.listdir(live_shm) and os.listdir(live_disk)

    assert main(_args(tmp_path, "--older-than", "0")) == 0
    out = capsys.readouterr().out
    assert "removed 2 director(ies)" in out and not os.path.exists(young_shm) and not os.path.exists(young_disk)
    assert os.listdir(live_shm) and os.listdir(live_disk), out  # its owner (this process) is alive
    assert f"kept: {live_disk} (disk; in use by live process(es) [{os.getpid()}]" in out


def _cleanup(*args):
    """`python -m lm_resiliency.cleanup ARGS --older-than 0`, the way a user runs it."""
    done = subprocess.run([sys.executable, "-m", "lm_resiliency.cleanup", *args, "--older-than", "0"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("case", ["folder-through-a-symlink-alias", "shared-memory-dir-elsewhere",
                                  "shared-memory-dir-missing", "heap-run"])
def test_cleanup_never_removes_a_live_runs_checkpoints(tmp_path, crashed_runs, case):
    """Issue 22, item 4: however the folder and the host-slot directory are named, and whatever
    holds the host slots, a live run keeps its node-local checkpoints and flushes again; the dead
    runs around it are still removed."""
    live = InMemoryCheckpointManager(InMemoryCkptConfig(
        run_id="live-heap-run", interval=1, disk_flush_interval=1, disk_folder=str(tmp_path / "disk"),
        host_memory="heap")) if case == "heap-run" else None
    if live is not None:
        live.save({"w": torch.ones(10)}, 1)
        live.maybe_wait()
        live.flush_now()
        _backdate(os.path.dirname(live.store.directory), 2 * 24 * 3600)
    live_disk = os.path.dirname(live.store.directory) if live else crashed_runs["live-run"][1]
    os.symlink(tmp_path, tmp_path / "alias")
    disk = str(tmp_path / ("alias" if case == "folder-through-a-symlink-alias" else "") / "disk")
    shm = {"shared-memory-dir-elsewhere": tmp_path / "other-shm", "shared-memory-dir-missing": tmp_path / "no-such"}
    (tmp_path / "other-shm").mkdir(mode=0o700)
    try:
        out = _cleanup("--shared-memory-dir", str(shm.get(case, tmp_path / "shm")), "--disk-folder", disk)
        assert os.path.isdir(live_disk) and any(f.endswith(".gemini") for _, _, fs in os.walk(live_disk) for f in fs)
        assert "in use by live process(es)" in out, out
        assert not os.path.exists(crashed_runs["old-run"][1]) and not os.path.exists(crashed_runs["young-run"][1]), out
        manager = live or crashed_runs["live-manager"]
        manager.save({"w": torch.full((10,), 2.0)}, 2)
        manager.maybe_wait()
        assert manager.flush_now() == 2  # the live run's next flush works
        assert manager.find_latest() == 2
    finally:
        if live is not None:
            live.close()


def test_age_parsing():
    assert [parse_age(t) for t in ("90", "90s", "30m", "24h", "7d", "0", "1.5h")] == \
        [90, 90, 1800, 86400, 604800, 0, 5400]
    with pytest.raises(ValueError, match="--older-than"):
        parse_age("yesterday")
