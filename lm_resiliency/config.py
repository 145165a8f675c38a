"""Configuration objects. Every field is validated at construction; errors name the field."""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional

_MIB = 1024 * 1024


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the accepted values."""


def _require(condition: bool, cls: str, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{cls}.{field}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class InMemoryCkptConfig:
    """GEMINI in-memory checkpoint configuration (see docs/gemini.md).

    `timeout_s` bounds every replication send/receive, store read and background wait.
    `host_memory` places the host slots: "shared" (default) in node-owned shared memory under
    `shared_memory_dir` (default /dev/shm/lm-resiliency-<uid>), so they survive a worker crash;
    "heap" in the worker's own memory (they die with it). See docs/gemini.md.
    """

    enable: bool = True
    interval: int = 10
    replication_jump: int = -1
    replication_chunk_size: int = 16 * _MIB
    disk_flush_interval: int = 100
    disk_folder: str = "./checkpoints"
    run_id: Optional[str] = None
    verify_integrity: bool = False
    skip_replication_if_hsdp: bool = True
    pin_memory: bool = True
    timeout_s: float = 300.0
    host_memory: str = "shared"
    shared_memory_dir: Optional[str] = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("enable", "verify_integrity", "skip_replication_if_hsdp", "pin_memory"):
            _require(isinstance(getattr(self, field), bool), name, field, "must be True or False")
        _require(_is_int(self.interval) and self.interval >= 1, name, "interval",
                 f"must be a positive integer number of optimizer steps, got {self.interval!r}")
        _require(_is_int(self.replication_jump)
                 and (self.replication_jump == -1 or self.replication_jump >= 1),
                 name, "replication_jump",
                 f"must be -1 (one node width) or a positive rank distance, got {self.replication_jump!r}")
        _require(_is_int(self.replication_chunk_size) and self.replication_chunk_size >= 1,
                 name, "replication_chunk_size",
                 f"must be a positive number of bytes, got {self.replication_chunk_size!r}")
        _require(_is_int(self.disk_flush_interval) and self.disk_flush_interval >= 0,
                 name, "disk_flush_interval",
                 f"must be >= 0 (0 disables periodic flush), got {self.disk_flush_interval!r}")
        _require(isinstance(self.disk_folder, str) and self.disk_folder != "", name, "disk_folder",
                 f"must be a non-empty path, got {self.disk_folder!r}")
        _require(self.run_id is None or (isinstance(self.run_id, str) and self.run_id.strip() != ""),
                 name, "run_id", f"must be None or a non-empty string, got {self.run_id!r}")
        _require(isinstance(self.host_memory, str) and self.host_memory in ("shared", "heap"),
                 name, "host_memory", f"must be 'shared' or 'heap', got {self.host_memory!r}")
        _require(self.shared_memory_dir is None
                 or (isinstance(self.shared_memory_dir, str) and self.shared_memory_dir.strip() != ""),
                 name, "shared_memory_dir",
                 f"must be None (default /dev/shm/lm-resiliency-<uid>) or a non-empty path, "
                 f"got {self.shared_memory_dir!r}")
        _require(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
                 and math.isfinite(self.timeout_s) and self.timeout_s > 0, name, "timeout_s",
                 f"must be a positive, finite number of seconds, got {self.timeout_s!r}")
