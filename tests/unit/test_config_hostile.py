"""Configuration refuses values that would only fail later (issue 13 item 16): time values past what
threading and timedelta accept, policy files with duplicate keys, a float schema_version, unreadable
or deeply nested policy files, and integer variables that Python's int() takes but are not plain
decimal numbers."""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from datetime import timedelta

import pytest

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.config import MAX_SECONDS, ConfigError
from lm_resiliency.settings import ResiliencyPolicy
from lm_resiliency.scout.config import ReplayHarnessConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCOUT_SECONDS = ("straggler_min_margin_s", "hang_stall_threshold_s", "dataloader_stall_threshold_s",
                 "checkpoint_io_stall_threshold_s", "monitor_poll_interval_s", "full_sweep_timeout_s")


def test_the_longest_accepted_time_is_accepted_by_every_wait():
    assert InMemoryCkptConfig(timeout_s=MAX_SECONDS).timeout_s == MAX_SECONDS
    assert threading.Lock().acquire(timeout=MAX_SECONDS)
    assert threading.Event().wait(0) is False and timedelta(seconds=MAX_SECONDS)
    for field in SCOUT_SECONDS:
        ReplayHarnessConfig(**{field: MAX_SECONDS})


@pytest.mark.parametrize("value", [1e13, MAX_SECONDS * 2, 10 ** 30])
def test_timeout_past_what_waits_accept_is_refused(value):
    with pytest.raises(OverflowError):
        threading.Lock().acquire(timeout=value)  # what happened later with such a value
    with pytest.raises(ConfigError, match=r"^InMemoryCkptConfig\.timeout_s: .*at most"):
        InMemoryCkptConfig(timeout_s=value)


@pytest.mark.parametrize("field", SCOUT_SECONDS)
def test_scout_time_values_are_bounded_too(field):
    with pytest.raises(ConfigError, match=rf"^ReplayHarnessConfig\.{field}: .*at most"):
        ReplayHarnessConfig(**{field: 1e13})


def _policy(tmp_path, text, suffix):
    path = tmp_path / f"policy{suffix}"
    path.write_text(text)
    return str(path)


def _refused(path, message):
    with pytest.raises(ConfigError) as info:
        ResiliencyPolicy.from_environment({"LM_RESILIENCY": path})
    assert f"policy file {path}" in str(info.value) and message in str(info.value), str(info.value)


def test_json_policy_with_duplicate_keys_is_refused(tmp_path):
    _refused(_policy(tmp_path, '{"schema_version": 2, "schema_version": 1, "interval": 3}', ".json"),
             "duplicate JSON key 'schema_version'")
    _refused(_policy(tmp_path, '{"schema_version": 1, "checkpoint": {"timeout_s": 1, "timeout_s": 2}}', ".json"),
             "duplicate JSON key 'timeout_s'")


@pytest.mark.parametrize("text, suffix", [('{"schema_version": 1.0}', ".json"), ("schema_version = 1.0\n", ".toml"),
                                          ('{"schema_version": true}', ".json")])
def test_schema_version_must_be_an_int(tmp_path, text, suffix):
    _refused(_policy(tmp_path, text, suffix), "not a policy file of this version: schema_version: expected 1, got ")


@pytest.mark.parametrize("text, suffix", [
    ('{"schema_version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", ".json"),
    ("schema_version = 1\nx = " + "[" * 100_000 + "]" * 100_000 + "\n", ".toml"),
], ids=["json", "toml"])
def test_deeply_nested_policy_file_is_a_config_error(tmp_path, text, suffix):
    path = _policy(tmp_path, text, suffix)
    with pytest.raises(ConfigError, match=f"policy file {path}: .*nested"):
        ResiliencyPolicy.from_environment({"LM_RESILIENCY": path})


def test_policy_file_that_is_not_a_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "policy.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="policy file is not a regular file; refusing to open it"):
        ResiliencyPolicy.from_environment({"LM_RESILIENCY": str(fifo)})


_UNREADABLE = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from lm_resiliency.config import ConfigError
from lm_resiliency.settings import ResiliencyPolicy
os.setgid(65534)
os.setuid(65534)
try:
    ResiliencyPolicy.from_environment({"LM_RESILIENCY": sys.argv[2]})
except ConfigError as exc:
    print("ConfigError:", exc)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs to drop to another uid")
def test_unreadable_policy_file_is_a_config_error():
    folder = tempfile.mkdtemp(prefix="lmr-policy-")  # pytest's tmp_path is not traversable by nobody
    try:
        os.chmod(folder, 0o755)
        path = os.path.join(folder, "policy.json")
        with open(path, "w") as f:
            f.write('{"schema_version": 1}')
        os.chmod(path, 0o600)  # root's; the child runs as nobody
        result = subprocess.run([sys.executable, "-c", _UNREADABLE, ROOT, path], capture_output=True,
                                text=True, timeout=120)
    finally:
        shutil.rmtree(folder)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ConfigError: policy file {path}: cannot open policy file: "), result.stdout
    assert "Permission denied" in result.stdout


@pytest.mark.parametrize("name", ["LM_RESILIENCY_INTERVAL", "LM_RESILIENCY_DISK_FLUSH_INTERVAL"])
@pytest.mark.parametrize("value", ["\u0663", "1_000", "1" * 23, "+5", "5.0"])
def test_integer_variables_take_ascii_digits_only_and_are_bounded(name, value):
    with pytest.raises(ConfigError, match=f"^{name}=.*ASCII digits"):
        ResiliencyPolicy.from_environment({"LM_RESILIENCY": "1", name: value})


def test_integer_variables_still_take_plain_numbers():
    policy = ResiliencyPolicy.from_environment({"LM_RESILIENCY": "1", "LM_RESILIENCY_INTERVAL": " 25 ",
                                                "LM_RESILIENCY_DISK_FLUSH_INTERVAL": "0"})
    assert policy.interval == 25 and policy.checkpoint.disk_flush_interval == 0
