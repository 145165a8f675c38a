"""LM_RESILIENCY_LOG_LEVEL in a real process: at INFO the library says what it does (the capture
cadence once, each flush, the summary at close); unset, only the one-line resume note shows; a bad
value is named and ignored; an application's own logging configuration prints each line once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from lm_resiliency.config import ConfigError, env_log_level

SCRIPT = textwrap.dedent("""
    import logging, sys, torch
    if sys.argv[2] == "app-logging":
        logging.basicConfig(level=logging.INFO, format="APP %(name)s: %(message)s")
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = InMemoryCkptConfig(disk_folder=sys.argv[1] + "/disk", shared_memory_dir=sys.argv[1] + "/shm",
                                run_id="logs", disk_flush_interval=4)
    session = enable_resiliency(model, optimizer, interval=2, checkpoint=config, enable_detection=False)
    for _ in range(5):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    session.close()
""")


def _run(tmp_path, level, mode="plain"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LM_RESILIENCY")}
    if level is not None:
        env["LM_RESILIENCY_LOG_LEVEL"] = level
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_info_says_the_cadence_once_each_flush_and_the_summary(tmp_path):
    err = _run(tmp_path, "info")
    assert err.count("GEMINI: captured step 2; capturing every 2 optimizer steps (not replicated, flushed to ") == 1
    assert "captured step 4" not in err  # the cadence did not change
    assert err.count("GEMINI: rank 0 flushed step 4 to ") == 1
    assert ("lm-resiliency: run 'logs' closing after 5 optimizer steps (0 to 5): 2 captures, newest recoverable "
            "step 4, RECOVERY_VERIFIED step none; SCOUT off;") in err
    assert "[rank 0] INFO lm_resiliency.session" in err


def test_unset_only_the_resume_note_shows_and_a_bad_value_is_named(tmp_path):
    err = _run(tmp_path, None)
    assert "lm-resiliency: started fresh: no GEMINI state of run 'logs'" in err
    assert "captured step" not in err and "closing after" not in err
    err = _run(tmp_path / "again", "chatty")
    assert "LM_RESILIENCY_LOG_LEVEL='CHATTY': expected one of DEBUG, INFO, WARNING, ERROR" in err
    assert "captured step" not in err


def test_an_applications_own_logging_prints_every_line_once(tmp_path):
    err = _run(tmp_path, "info", "app-logging")
    assert err.count("closing after 5 optimizer steps") == 1
    assert "APP lm_resiliency.session_activity: lm-resiliency: run 'logs' closing after" in err


def test_the_variable_is_read_by_config():
    assert env_log_level({}) is None and env_log_level({"LM_RESILIENCY_LOG_LEVEL": " debug "}) == "DEBUG"
    with pytest.raises(ConfigError, match="LM_RESILIENCY_LOG_LEVEL='LOUD'"):
        env_log_level({"LM_RESILIENCY_LOG_LEVEL": "loud"})


def test_the_one_node_pairing_note_is_said_once_per_process(monkeypatch, caplog):
    from lm_resiliency.gemini import replication

    monkeypatch.setattr(replication, "_warned_one_node", False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with caplog.at_level("WARNING", logger="lm_resiliency.gemini.replication"):
        assert [replication.resolve_jump(-1, 4) for _ in range(3)] == [2, 2, 2]
    notes = [r.getMessage() for r in caplog.records if "appear to share one node" in r.getMessage()]
    assert notes == ["GEMINI: all 4 ranks appear to share one node; replicating to rank + 2, which protects "
                     "against a process crash but not against losing the node"]
