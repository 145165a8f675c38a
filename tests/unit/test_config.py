"""InMemoryCkptConfig: the guide's defaults, field-named validation errors, immutability. ResiliencyPolicy:
the one parser of the LM_RESILIENCY* environment and policy files (Lightning entry point, Accelerate flag)."""

import dataclasses
import json
import math

import pytest

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.config import ConfigError, env_keep_shared_memory, env_resume_step, env_run_id
from lm_resiliency.settings import ResiliencyPolicy, read_settings
from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.scout.config import ReplayHarnessConfig

MIB = 1024 * 1024

# The GEMINI guide's "Configuration" section, plus the documented timeout_s bound. The guide's
# example passes verify_integrity=False explicitly; its default is True (issue 22: checksums on by
# default, docs/gemini.md "Configuration").
GUIDE_DEFAULTS = {
    "enable": True,
    "interval": 10,
    "replication_jump": -1,
    "replication_chunk_size": 16 * MIB,
    "disk_flush_interval": 100,
    "disk_folder": "./checkpoints",
    "run_id": None,
    "verify_integrity": True,
    "skip_replication_if_hsdp": True,
    "pin_memory": True,
    "timeout_s": 300.0,
    "host_memory": "shared",
    "shared_memory_dir": None,
    "reap_other_runs_after_s": 86400.0,  # docs/gemini.md, "Run identity"
    "check_finite": True,
}


def test_defaults_match_the_guide():
    config = InMemoryCkptConfig()
    actual = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    assert actual == GUIDE_DEFAULTS
    for name, value in GUIDE_DEFAULTS.items():
        assert type(actual[name]) is type(value), name


def test_guide_example_constructs():
    config = InMemoryCkptConfig(
        enable=True, interval=10, replication_jump=-1, replication_chunk_size=16 * MIB,
        disk_flush_interval=100, disk_folder="./checkpoints", run_id="training-run-2026-08-15",
        verify_integrity=False, skip_replication_if_hsdp=True, pin_memory=True)
    assert config.run_id == "training-run-2026-08-15"


@pytest.mark.parametrize("field, value", [
    ("interval", 1), ("replication_jump", 1), ("replication_jump", 8),
    ("replication_chunk_size", 512), ("replication_chunk_size", 1 << 30), ("disk_flush_interval", 0),
    ("disk_folder", "/tmp/x"), ("disk_folder", "relative/dir"), ("run_id", "r"), ("timeout_s", 0.5), ("timeout_s", 2),
    ("timeout_s", 0.01), ("interval", 10 ** 9), ("disk_flush_interval", 10 ** 9),
    ("reap_other_runs_after_s", 0), ("reap_other_runs_after_s", 3600), ("reap_other_runs_after_s", math.inf),
])
def test_boundary_values_accepted(field, value):
    assert getattr(InMemoryCkptConfig(**{field: value}), field) == value


BAD_VALUES = [
    ("interval", 0), ("interval", -1), ("interval", 1.5), ("interval", True),
    ("replication_jump", 0), ("replication_jump", -2),
    ("replication_chunk_size", 0), ("replication_chunk_size", 1), ("replication_chunk_size", 511),
    ("replication_chunk_size", (1 << 30) + 1),
    ("disk_flush_interval", -1), ("disk_flush_interval", 2 ** 63 - 1), ("interval", 2 ** 63 - 1), ("interval", 10 ** 9 + 1),
    ("disk_folder", ""), ("disk_folder", "/tmp/a\0b"), ("shared_memory_dir", "/dev/shm/x\0"),
    ("timeout_s", 1e-300), ("timeout_s", 0.0099),
    ("run_id", ""), ("run_id", "  "), ("run_id", "none"), ("run_id", " None "),
    ("reap_other_runs_after_s", -1), ("reap_other_runs_after_s", math.nan), ("reap_other_runs_after_s", "1h"),
    ("reap_other_runs_after_s", True),
    ("enable", 1), ("verify_integrity", 1), ("skip_replication_if_hsdp", 1), ("pin_memory", 1),
    ("check_finite", "yes"),
    ("timeout_s", 0), ("timeout_s", -1.0), ("timeout_s", math.nan), ("timeout_s", True),
    ("timeout_s", "300"), ("interval", "10"), ("disk_folder", None), ("run_id", 7),
]


@pytest.mark.parametrize("field, value", BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_bad_value_raises_config_error_naming_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        InMemoryCkptConfig(**{field: value})
    assert isinstance(info.value, ValueError)
    assert f"InMemoryCkptConfig.{field}" in str(info.value)


def test_infinite_timeout_rejected():
    with pytest.raises(ConfigError, match="InMemoryCkptConfig.timeout_s"):
        InMemoryCkptConfig(timeout_s=math.inf)


def test_config_is_frozen():
    config = InMemoryCkptConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.interval = 5  # type: ignore[misc]
    assert config.interval == 10
    assert dataclasses.replace(config, interval=5).interval == 5


# ------------------------------------------------------------------ ResiliencyPolicy


@pytest.mark.parametrize("environ", [{}, {"LM_RESILIENCY": ""}, {"LM_RESILIENCY": "0"}, {"LM_RESILIENCY": "off"},
                                     {"LM_RESILIENCY": " False "}, {"LM_RESILIENCY": "no"},
                                     {"LM_RESILIENCY": "0", "LM_RESILIENCY_INTERVAL": "not-read-when-off"}])
def test_policy_unset_or_off_is_inert(environ):
    assert ResiliencyPolicy.from_environment(environ) is None


@pytest.mark.parametrize("switch", ["1", "true", "YES", "on"])
def test_policy_switch_on_sets_nothing_else(switch):
    policy = ResiliencyPolicy.from_environment({"LM_RESILIENCY": switch})
    assert policy == ResiliencyPolicy() and policy.arguments() == {}


def test_policy_variables():
    policy = ResiliencyPolicy.from_environment({
        "LM_RESILIENCY": "1", "LM_RESILIENCY_INTERVAL": "5", "LM_RESILIENCY_DIR": "/tmp/g",
        "LM_RESILIENCY_SHM_DIR": "/tmp/s", "LM_RESILIENCY_DISK_FLUSH_INTERVAL": "0", "LM_RESILIENCY_DETECTION": "0",
        "LM_RESILIENCY_DATALOADER_RESUME": "continue"})
    assert policy.arguments() == {"interval": 5, "enable_detection": False, "checkpoint": InMemoryCkptConfig(
        disk_folder="/tmp/g", shared_memory_dir="/tmp/s", disk_flush_interval=0)}
    assert policy.resume_dataloaders == "continue" and policy.source is None


POLICY_TOML = """schema_version = 1
interval = 3
enable_detection = false
recovery_mode = "recovery_verified"

[checkpoint]
disk_folder = "/tmp/g"
run_id = "r"
disk_flush_interval = 4

[replay]
hang_stall_threshold_s = 60.0
"""


def test_policy_file_toml_and_json_say_the_same(tmp_path):
    toml = tmp_path / "policy.toml"
    toml.write_text(POLICY_TOML)
    policy = ResiliencyPolicy.from_environment({"LM_RESILIENCY": str(toml)})
    assert policy.source == str(toml)
    assert policy.arguments() == {
        "interval": 3, "enable_detection": False, "recovery_mode": RecoveryMode.RECOVERY_VERIFIED,
        "checkpoint": InMemoryCkptConfig(disk_folder="/tmp/g", run_id="r", disk_flush_interval=4),
        "replay": ReplayHarnessConfig(hang_stall_threshold_s=60.0)}
    as_json = tmp_path / "policy.json"
    as_json.write_text(json.dumps({"schema_version": 1, "interval": 3, "enable_detection": False,
                                   "recovery_mode": "recovery_verified",
                                   "checkpoint": {"disk_folder": "/tmp/g", "run_id": "r", "disk_flush_interval": 4},
                                   "replay": {"hang_stall_threshold_s": 60.0}}))
    assert ResiliencyPolicy.from_environment({"LM_RESILIENCY": str(as_json)}).arguments() == policy.arguments()


def test_variables_override_the_policy_file(tmp_path):
    toml = tmp_path / "policy.toml"
    toml.write_text(POLICY_TOML)
    policy = ResiliencyPolicy.from_environment({"LM_RESILIENCY": str(toml), "LM_RESILIENCY_INTERVAL": "7",
                                                "LM_RESILIENCY_DIR": "/tmp/d", "LM_RESILIENCY_DETECTION": "1"})
    assert policy.interval == 7 and policy.enable_detection is True
    # Only the named checkpoint fields change; the file's other fields stay.
    assert policy.checkpoint == InMemoryCkptConfig(disk_folder="/tmp/d", run_id="r", disk_flush_interval=4)


BAD_FILES = [  # (file text, suffix, what the error must name besides the file)
    ('schema_version = 1\nintervall = 3\n', ".toml", "unknown key(s) ['intervall'] in a policy file; accepted: ['checkpoint',"),
    ('interval = 3\n', ".toml", "schema_version: expected 1, got nothing"),
    ('schema_version = 2\n', ".toml", "schema_version: expected 1, got 2"),
    ('schema_version = 1\ninterval = 0\n', ".toml", ": interval must be at least 1, got 0"),
    ('schema_version = 1\ninterval = 1000000001\n', ".toml", ": interval must be at most 1000000000, got 1000000001"),
    ('schema_version = 1\nenable_detection = "no"\n', ".toml", ": enable_detection must be bool, got str 'no'"),
    ('schema_version = 1\nrecovery_mode = "newest"\n', ".toml", ": recovery_mode must be one of"),
    ('schema_version = 1\n[checkpoint]\ninterval_s = 4\n', ".toml",
     ": checkpoint: unknown InMemoryCkptConfig field(s) ['interval_s']"),
    ('schema_version = 1\n[checkpoint]\ndisk_flush_interval = -1\n', ".toml",
     ": checkpoint: InMemoryCkptConfig.disk_flush_interval"),
    ('schema_version = 1\n[replay]\nhang_stall_threshold_s = -1.0\n', ".toml",
     ": replay: ReplayHarnessConfig.hang_stall_threshold_s"),
    ('schema_version = 1\ncheckpoint = 3\n', ".toml", ": checkpoint must be dict, got int 3"),
    ('schema_version = 1\ninterval = \n', ".toml", "not valid TOML"),
    ('{"schema_version": 1, "interval": 3,}', ".json", "not valid JSON"),
    ('[1, 2]', ".json", "the document is not a JSON object (list)"),
]


@pytest.mark.parametrize("text, suffix, message", BAD_FILES, ids=[m for _, _, m in BAD_FILES])
def test_malformed_policy_file_names_the_file_and_the_field(tmp_path, text, suffix, message):
    path = tmp_path / f"policy{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        ResiliencyPolicy.from_environment({"LM_RESILIENCY": str(path)})
    assert f"policy file {path}" in str(info.value) and message in str(info.value)


def test_missing_or_unsuffixed_policy_file_is_refused(tmp_path):
    for value in ("maybe", str(tmp_path / "missing.toml")):
        with pytest.raises(ConfigError, match="LM_RESILIENCY=.*no such file exists"):
            ResiliencyPolicy.from_environment({"LM_RESILIENCY": value})
    yaml = tmp_path / "policy.yaml"
    yaml.write_text("interval: 3\n")
    with pytest.raises(ConfigError, match="must end in .toml or .json"):
        ResiliencyPolicy.from_environment({"LM_RESILIENCY": str(yaml)})


@pytest.mark.parametrize("name, value", [
    ("LM_RESILIENCY_INTERVAL", "0"), ("LM_RESILIENCY_INTERVAL", "ten"), ("LM_RESILIENCY_DISK_FLUSH_INTERVAL", "-1"),
    ("LM_RESILIENCY_DETECTION", "maybe"), ("LM_RESILIENCY_DATALOADER_RESUME", "rewind"),
])
def test_bad_variable_is_named(name, value):
    with pytest.raises(ConfigError, match=f"^{name}="):
        ResiliencyPolicy.from_environment({"LM_RESILIENCY": "1", name: value})


def test_read_settings_is_the_deepspeed_section_parser_too():
    assert read_settings({"interval": 2, "enable_checkpoint": False}, "section", "section.") == {
        "interval": 2, "enable_checkpoint": False}
    with pytest.raises(ConfigError, match=r"^section: the document is not a JSON object \(list\)"):
        read_settings([], "section", "section.")
    with pytest.raises(ConfigError, match=r"^section: interval must be int, got bool True"):
        read_settings({"interval": True}, "section", "section.")


def test_variables_read_whatever_lm_resiliency_says():
    assert env_run_id({"LM_RESILIENCY_RUN_ID": "my-run"}) == "my-run" and env_run_id({}) is None
    keep = "LM_RESILIENCY_KEEP_SHARED_MEMORY"
    assert [env_keep_shared_memory({keep: v}) for v in ("1", "yes", " on ")] == [True, True, True]
    assert [env_keep_shared_memory({keep: v}) for v in ("", "0", "false", "OFF")] == [False] * 4
    assert env_keep_shared_memory({}) is False
    step = "LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"
    assert env_resume_step({}) is None and env_resume_step({step: ""}) is None
    assert env_resume_step({step: "120"}) == 120
    for bad in ("-1", "1_000", "3.5", "x"):
        with pytest.raises(ConfigError, match=f"{step}={bad!r}: expected an integer >= 0"):
            env_resume_step({step: bad})
