"""InMemoryCkptConfig: the guide's defaults, field-named validation errors, immutability."""

import dataclasses
import math

import pytest

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.config import ConfigError

MIB = 1024 * 1024

# The GEMINI guide's "Configuration" section, plus the documented timeout_s bound.
GUIDE_DEFAULTS = {
    "enable": True,
    "interval": 10,
    "replication_jump": -1,
    "replication_chunk_size": 16 * MIB,
    "disk_flush_interval": 100,
    "disk_folder": "./checkpoints",
    "run_id": None,
    "verify_integrity": False,
    "skip_replication_if_hsdp": True,
    "pin_memory": True,
    "timeout_s": 300.0,
    "host_memory": "shared",
    "shared_memory_dir": None,
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
    ("replication_chunk_size", 1), ("disk_flush_interval", 0), ("disk_folder", "/tmp/x"),
    ("run_id", "r"), ("timeout_s", 0.5), ("timeout_s", 2),
])
def test_boundary_values_accepted(field, value):
    assert getattr(InMemoryCkptConfig(**{field: value}), field) == value


BAD_VALUES = [
    ("interval", 0), ("interval", -1), ("interval", 1.5), ("interval", True),
    ("replication_jump", 0), ("replication_jump", -2),
    ("replication_chunk_size", 0),
    ("disk_flush_interval", -1),
    ("disk_folder", ""),
    ("run_id", ""), ("run_id", "  "),
    ("enable", 1), ("verify_integrity", 1), ("skip_replication_if_hsdp", 1), ("pin_memory", 1),
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
