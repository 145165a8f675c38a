"""Policy files (the opt-in policy file and torchrun's worker policy) go through one reader: file
trust (a FIFO refused at once, no link, not writable by group or others, this user's or root's),
one size bound, one version check, and values that would break a run refused with the field named
(issue 22 items 7 and 10)."""

import os

import pytest

from lm_resiliency.config import ConfigError
from lm_resiliency.files import RecordRejected
from lm_resiliency.settings import POLICY_MAX_BYTES, ResiliencyPolicy
from lm_resiliency.torchrun.policy import parse_policy, read_policy_bytes
from tests.fifo import refusal_without_blocking

GOOD = """schema_version = 1
interval = 2
enable_checkpoint = true

[checkpoint]
disk_folder = "/tmp/lmr-records-policy"
"""


def _write(tmp_path, text=GOOD, name="worker.toml", mode=0o644):
    path = tmp_path / name
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def _worker(path):
    return parse_policy(path, read_policy_bytes(path))


def _opt_in(path):
    return ResiliencyPolicy.from_environment({"LM_RESILIENCY": path})


def test_a_good_policy_is_read_by_both_readers(tmp_path):
    path = _write(tmp_path)
    assert _worker(path).arguments["interval"] == 2
    assert _opt_in(path).interval == 2


def test_a_fifo_worker_policy_is_refused_at_once(tmp_path):
    fifo = str(tmp_path / "worker.toml")
    os.mkfifo(fifo, 0o600)
    error = refusal_without_blocking(lambda: read_policy_bytes(fifo), fifo)
    assert isinstance(error, ConfigError) and isinstance(error, RecordRejected)
    assert str(error) == f"worker policy {fifo}: policy file is not a regular file; refusing to open it"


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o664, 0o620], ids=oct)
def test_a_policy_others_may_write_is_refused(tmp_path, mode):
    path = _write(tmp_path, mode=mode)
    with pytest.raises(ConfigError, match=f"worker policy {path}: policy file has mode {mode:o}; expected 0644 at most"):
        _worker(path)
    with pytest.raises(ConfigError, match=f"policy file {path}: policy file has mode {mode:o}"):
        _opt_in(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_policy_owned_by_another_user_is_refused(tmp_path):
    path = _write(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match=r"policy file is owned by uid 65534, not by uid 0"):
        _worker(path)


def test_a_symlinked_or_oversized_policy_is_refused(tmp_path):
    target = _write(tmp_path)
    link = tmp_path / "link.toml"
    os.symlink(target, link)
    with pytest.raises(ConfigError, match="policy file is a symbolic link; refusing to follow it"):
        _worker(str(link))
    with pytest.raises(ConfigError, match="policy file is a symbolic link"):
        _opt_in(str(link))
    big = _write(tmp_path, GOOD + "#" * POLICY_MAX_BYTES, "big.toml")
    with pytest.raises(ConfigError, match=f"larger than {POLICY_MAX_BYTES} bytes"):
        _worker(big)
    with pytest.raises(ConfigError, match=r"worker policy .*missing.toml: no such file exists"):
        read_policy_bytes(str(tmp_path / "missing.toml"))


@pytest.mark.parametrize("adapter", ["os:system", "subprocess:run", "builtins:exec", "importlib.util:find_spec"])
def test_an_adapter_from_the_standard_library_is_refused(tmp_path, adapter):
    path = _write(tmp_path, GOOD.replace("interval = 2", f'interval = 2\nadapter = "{adapter}"'))
    with pytest.raises(ConfigError, match=f"adapter: '{adapter}' names the standard library"):
        _worker(path)


def test_a_stack_adapter_is_accepted(tmp_path):
    path = _write(tmp_path, GOOD.replace("interval = 2", 'interval = 2\nadapter = "my_stack.resiliency:factory"'))
    assert _worker(path).adapter == "my_stack.resiliency:factory"


BREAKING = [  # (policy text, what the error must say)
    ("[checkpoint]\nreplication_chunk_size = 1\n", "InMemoryCkptConfig.replication_chunk_size: must be a number of "
     "bytes, at least 512"),
    ("[checkpoint]\ntimeout_s = 1e-300\n", "InMemoryCkptConfig.timeout_s: must be a finite number of seconds, at "
     "least 0.01"),
    ("interval = 9223372036854775807\n", "interval must be at most 1000000000, got 9223372036854775807"),
    ("[checkpoint]\ninterval = 9223372036854775807\n", "InMemoryCkptConfig.interval: must be a positive integer"),
    ("[checkpoint]\ndisk_flush_interval = 9223372036854775807\n", "InMemoryCkptConfig.disk_flush_interval"),
    ("[replay]\ncheck_interval = 9223372036854775807\n", "ReplayHarnessConfig.check_interval"),
    ('[checkpoint]\ndisk_folder = "/tmp/a\\u0000b"\n', "InMemoryCkptConfig.disk_folder: must be a non-empty path "
     "without NUL"),
    ('[checkpoint]\ndisk_folder = "checkpoints"\n', "checkpoint.disk_folder: must be an absolute path, got "
     "'checkpoints'"),
    ('[checkpoint]\nshared_memory_dir = "shm"\n', "checkpoint.shared_memory_dir: must be an absolute path"),
    ("enable_checkpoint = true\n[checkpoint]\nenable = false\n", "checkpoint.enable = false contradicts "
     "worker policy"),
    ("enable_checkpoint = false\n[checkpoint]\nenable = true\n", "checkpoint.enable = true contradicts"),
]


@pytest.mark.parametrize("text, message", BREAKING, ids=[m.split(":")[0][:40] for _, m in BREAKING])
def test_values_that_would_break_a_run_are_refused_naming_the_field(tmp_path, text, message):
    path = _write(tmp_path, "schema_version = 1\n" + text)
    with pytest.raises(ConfigError) as info:
        _worker(path)
    assert str(info.value).startswith(f"worker policy {path}: ") and message in str(info.value), str(info.value)
    as_opt_in = _write(tmp_path, "schema_version = 1\n" + text, "policy.toml")
    with pytest.raises(ConfigError, match=f"policy file {as_opt_in}: "):
        _opt_in(as_opt_in)


def test_one_switch_is_not_a_contradiction(tmp_path):
    off = _worker(_write(tmp_path, "schema_version = 1\n[checkpoint]\nenable = false\ndisk_folder = \"/x\"\n"))
    assert off.arguments["checkpoint"].enable is False
    both = _worker(_write(tmp_path, "schema_version = 1\nenable_checkpoint = false\n[checkpoint]\nenable = false\n",
                          "both.toml"))
    assert both.arguments["enable_checkpoint"] is False
