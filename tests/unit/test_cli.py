"""The `lm-resiliency` command: help on every subcommand, exit statuses, JSON output, the old entry
points, timeline without matplotlib, and inspect/timeline on a one-process run relaunched once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("command, expected", [
    ("inspect", "usage: lm-resiliency inspect"), ("timeline", "usage: lm-resiliency timeline"),
    ("cleanup", "usage: python -m lm_resiliency.cleanup"),
    ("discover-moe-regimes", "usage: lm-resiliency-discover-moe-regimes")])
def test_every_subcommand_has_help(command, expected, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and expected in capsys.readouterr().out


def test_python_dash_m_and_usage_errors():
    top = subprocess.run([sys.executable, "-m", "lm_resiliency", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert top.returncode == 0
    assert all(name in top.stdout for name in ("inspect", "timeline", "cleanup", "discover-moe-regimes"))
    bare = subprocess.run([sys.executable, "-m", "lm_resiliency"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert bare.returncode == 2 and "the following arguments are required: COMMAND" in bare.stderr
    old = subprocess.run([sys.executable, "-m", "lm_resiliency.cleanup", "--dry-run", "--shared-memory-dir",
                          os.path.join(ROOT, "no-such-dir")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert old.returncode == 0 and "would remove 0 director(ies)" in old.stdout


def test_inspect_of_an_empty_folder_and_of_a_run_that_is_not_there(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "disk"), "--shared-memory-dir", str(tmp_path / "shm")]) == 0
    assert "no runs found" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "disk"), "--shared-memory-dir", str(tmp_path / "shm"), "--run-id", "x",
                 "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["runs"] == [] and doc["relaunch"]["step"] is None
    assert doc["relaunch"]["reason"].startswith("a relaunch of run 'x' starts fresh: no state of run 'x' in ")
    assert main(["inspect", str(tmp_path), "--world-size", "0"]) == 2


def _launch(tmp_path, steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = InMemoryCkptConfig(disk_folder=str(tmp_path / "disk"), shared_memory_dir=str(tmp_path / "shm"),
                                run_id="cli", disk_flush_interval=2)
    session = enable_resiliency(model, optimizer, interval=2, checkpoint=config, enable_detection=False)
    for _ in range(session.step_count, steps):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    directory = os.path.dirname(session.manager.store.directory)
    session.close()
    return directory


def test_inspect_and_timeline_of_a_relaunched_run(tmp_path, capsys):
    _launch(tmp_path, 5)
    run_dir = _launch(tmp_path, 8)
    assert main(["inspect", str(tmp_path / "disk"), "--shared-memory-dir", str(tmp_path / "shm"), "--run-id", "cli",
                 "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "run 'cli': 1 ranks, pytorch/single" in out and "2 launch(es)" in out
    assert "a relaunch of run 'cli' on 1 ranks resumes at step 8: the newest step every rank can load" in out

    picture = tmp_path / "picture.png"
    assert main(["timeline", str(tmp_path / "disk"), "--out", str(picture), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["directory"] == run_dir and doc["picture"] == str(picture) and picture.stat().st_size > 10000
    assert [(g["resumed_step"], g["captures"], g["end"]) for g in doc["generations"]] == [
        (0, [2, 4], "closed at step 5"), (4, [6, 8], "closed at step 8")]


def test_timeline_without_matplotlib_prints_the_table_and_says_how_to_get_the_picture(tmp_path, capsys,
                                                                                      monkeypatch):
    run_dir = _launch(tmp_path, 3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails
    assert main(["timeline", run_dir, "--out", str(tmp_path / "picture.png")]) == 3
    out = capsys.readouterr().out
    assert "generation 0: fresh, captures 2..2 (1), closed at step 3" in out
    assert 'no picture: matplotlib is not installed, so no picture is drawn: pip install "lm-resiliency[demo]"' in out
    assert not (tmp_path / "picture.png").exists()
    assert main(["timeline", str(tmp_path / "nothing-here")]) == 1
    assert "no such directory" in capsys.readouterr().err
