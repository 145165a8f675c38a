"""GEMINI's `InMemoryCkptConfig` (every field validated at construction; errors name the field) and
the one reader of every `LM_RESILIENCY*` variable: the opt-in policy's (`read_policy_environment`;
the policy itself, its files and `read_settings` are `lm_resiliency.settings`, a layer up, since
they build SCOUT's `ReplayHarnessConfig`) and the variables read whatever LM_RESILIENCY says
(`env_run_id`, `env_keep_shared_memory`, `env_resume_step`, `env_log_level`)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

# ConfigError, MAX_SECONDS and is_seconds live in _values so SCOUT's config shares them without
# importing this module; they stay importable from here.
from lm_resiliency._values import MAX_SECONDS, MAX_STEP_INTERVAL, ConfigError, is_seconds, is_step_interval
from lm_resiliency._values import is_int as _is_int

_MIB = 1024 * 1024
# Replication chunk bounds: below MIN_CHUNK_BYTES the per-send overhead is the whole cost (a 1-byte
# chunk is one send per byte); above MAX_CHUNK_BYTES one send holds a GiB in flight and nears
# gloo's 32-bit message sizes.
MIN_CHUNK_BYTES = 512
MAX_CHUNK_BYTES = 1024 * _MIB
# timeout_s at least this: below it every store read and send expires before one round trip
# (timedelta's resolution is a microsecond; 1e-300 s is 0 to a process group).
MIN_TIMEOUT_S = 0.01
DEFAULT_REAP_OTHER_RUNS_AFTER_S = 24 * 3600.0


def _is_path(value: object) -> bool:
    return isinstance(value, str) and value != "" and "\0" not in value


def _require(condition: bool, cls: str, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{cls}.{field}: {message}")


@dataclass(frozen=True)
class InMemoryCkptConfig:
    """GEMINI in-memory checkpoint configuration (see docs/gemini.md).

    `timeout_s` bounds every replication send/receive, store read and background wait.
    `host_memory` places the host slots: "shared" (default) in node-owned shared memory under
    `shared_memory_dir` (default /dev/shm/lm-resiliency-<uid>), so they survive a worker crash;
    "heap" in the worker's own memory (they die with it). See docs/gemini.md.
    `run_id` is the identity a relaunch must share to recover (docs/gemini.md, "Run identity").
    `disk_folder` may be relative; it is resolved once, against the working directory, when
    GEMINI attaches: relaunch from the same directory or give an absolute path.
    `reap_other_runs_after_s`: a starting job removes shared-memory slots of OTHER run ids whose
    processes are dead only when they were last written this many seconds ago (default 24 h;
    `math.inf`: never; `python -m lm_resiliency.cleanup` removes them on demand).
    `verify_integrity` (default True) checksums every capture once, right after its copy, and
    checks the bytes against that checksum at every hand-off (replica receipt, flush, recovery);
    state without a checksum (written with it off) is then not eligible for recovery.
    `check_finite` refuses a capture with NaN or Inf in parameters or optimizer state, its param
    groups' values (`lr`) included (the session checks those; a direct `save()` checks every
    floating tensor, Python float and NumPy value of the state): it is never published as
    recoverable or certified, and `NonFiniteState` is raised.
    """

    enable: bool = True
    interval: int = 10
    replication_jump: int = -1
    replication_chunk_size: int = 16 * _MIB
    disk_flush_interval: int = 100
    disk_folder: str = "./checkpoints"
    run_id: Optional[str] = None
    verify_integrity: bool = True
    skip_replication_if_hsdp: bool = True
    pin_memory: bool = True
    timeout_s: float = 300.0
    host_memory: str = "shared"
    shared_memory_dir: Optional[str] = None
    reap_other_runs_after_s: float = DEFAULT_REAP_OTHER_RUNS_AFTER_S
    check_finite: bool = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("enable", "verify_integrity", "skip_replication_if_hsdp", "pin_memory", "check_finite"):
            _require(isinstance(getattr(self, field), bool), name, field, "must be True or False")
        _require(is_step_interval(self.interval), name, "interval",
                 f"must be a positive integer number of optimizer steps, at most {MAX_STEP_INTERVAL}, "
                 f"got {self.interval!r}")
        _require(_is_int(self.replication_jump)
                 and (self.replication_jump == -1 or self.replication_jump >= 1),
                 name, "replication_jump",
                 f"must be -1 (one node width) or a positive rank distance, got {self.replication_jump!r}")
        _require(_is_int(self.replication_chunk_size)
                 and MIN_CHUNK_BYTES <= self.replication_chunk_size <= MAX_CHUNK_BYTES,
                 name, "replication_chunk_size",
                 f"must be a number of bytes, at least {MIN_CHUNK_BYTES} and at most {MAX_CHUNK_BYTES} (1 GiB), "
                 f"got {self.replication_chunk_size!r}")
        _require(is_step_interval(self.disk_flush_interval, 0), name, "disk_flush_interval",
                 f"must be from 0 (0 disables periodic flush) to {MAX_STEP_INTERVAL}, got {self.disk_flush_interval!r}")
        _require(_is_path(self.disk_folder), name, "disk_folder",
                 f"must be a non-empty path without NUL characters, got {self.disk_folder!r}")
        _require(self.run_id is None or (isinstance(self.run_id, str) and self.run_id.strip() != ""
                                         and self.run_id.strip().lower() != "none"),
                 name, "run_id", f"must be None or a non-empty string other than 'none' (a placeholder "
                 f"that names no run), got {self.run_id!r}")
        _require(isinstance(self.host_memory, str) and self.host_memory in ("shared", "heap"),
                 name, "host_memory", f"must be 'shared' or 'heap', got {self.host_memory!r}")
        _require(self.shared_memory_dir is None
                 or (_is_path(self.shared_memory_dir) and self.shared_memory_dir.strip() != ""),
                 name, "shared_memory_dir",
                 f"must be None (default /dev/shm/lm-resiliency-<uid>) or a non-empty path without NUL "
                 f"characters, got {self.shared_memory_dir!r}")
        _require(is_seconds(self.timeout_s) and self.timeout_s >= MIN_TIMEOUT_S, name, "timeout_s",
                 f"must be a finite number of seconds, at least {MIN_TIMEOUT_S:g} and at most {MAX_SECONDS:g}, "
                 f"got {self.timeout_s!r}")
        _require(isinstance(self.reap_other_runs_after_s, (int, float))
                 and not isinstance(self.reap_other_runs_after_s, bool)
                 and not math.isnan(self.reap_other_runs_after_s) and self.reap_other_runs_after_s >= 0,
                 name, "reap_other_runs_after_s",
                 f"must be a number of seconds >= 0 (math.inf: never), got {self.reap_other_runs_after_s!r}")


# ------------------------------------------------------------------ the opt-in policy's variables

ENABLE_ENV = "LM_RESILIENCY"
# What Accelerate's prepared dataloaders do after a recovery (see lm_resiliency.adapters.accelerate).
DATALOADER_RESUME_MODES = ("auto", "continue", "manual")
# Integer variables: ASCII digits only (int() also takes '1_000' and other scripts' digits), bounded.
_MAX_ENV_DIGITS = 9
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class PolicyEnvironment:
    """The validated `LM_RESILIENCY*` variables of the zero-code opt-ins (what
    `lm_resiliency.settings.ResiliencyPolicy` is built from). `policy_file` is LM_RESILIENCY's
    path, or None when it just says "on"; `checkpoint` holds InMemoryCkptConfig field overrides."""

    policy_file: Optional[str] = None
    interval: Optional[int] = None
    checkpoint: Dict[str, Any] = dataclasses.field(default_factory=dict)
    enable_detection: Optional[bool] = None
    resume_dataloaders: Optional[str] = None


def read_policy_environment(environ: Optional[Mapping[str, str]] = None) -> Optional[PolicyEnvironment]:
    """The opt-in variables (see `lm_resiliency.settings.ResiliencyPolicy`), or None when
    LM_RESILIENCY is off (nothing else is read then). Bad values raise ConfigError naming the variable."""
    env = os.environ if environ is None else environ
    switch = env.get(ENABLE_ENV, "").strip()
    if switch.lower() in ("",) + _OFF:
        return None
    checkpoint: Dict[str, Any] = {}
    for name, field in (("LM_RESILIENCY_DIR", "disk_folder"), ("LM_RESILIENCY_SHM_DIR", "shared_memory_dir")):
        if env.get(name, "").strip():
            checkpoint[field] = env[name].strip()
    flush = _env_int(env, "LM_RESILIENCY_DISK_FLUSH_INTERVAL", 0)
    if flush is not None:
        checkpoint["disk_flush_interval"] = flush
    detection = env.get("LM_RESILIENCY_DETECTION", "").strip().lower()
    if detection and detection not in _ON + _OFF:
        raise ConfigError(f"LM_RESILIENCY_DETECTION={env['LM_RESILIENCY_DETECTION']!r}: expected 1 "
                          "(SCOUT on) or 0 (off)")
    resume = env.get("LM_RESILIENCY_DATALOADER_RESUME", "").strip().lower()
    if resume and resume not in DATALOADER_RESUME_MODES:
        raise ConfigError(f"LM_RESILIENCY_DATALOADER_RESUME={resume!r}: expected one of {DATALOADER_RESUME_MODES}")
    return PolicyEnvironment(policy_file=None if switch.lower() in _ON else switch,
                             interval=_env_int(env, "LM_RESILIENCY_INTERVAL", 1), checkpoint=checkpoint,
                             enable_detection=(detection in _ON) if detection else None,
                             resume_dataloaders=resume or None)


# Variables read whether or not LM_RESILIENCY is on: by GEMINI (run identity, keeping shared
# memory across a planned stop) and by the fault kit (the step a relaunch resumes after).
RUN_ID_ENV = "LM_RESILIENCY_RUN_ID"
KEEP_SHARED_MEMORY_ENV = "LM_RESILIENCY_KEEP_SHARED_MEMORY"
RESUME_STEP_ENV = "LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"
LOG_LEVEL_ENV = "LM_RESILIENCY_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def env_run_id(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """LM_RESILIENCY_RUN_ID as set (None when unset); GEMINI's identity rules judge the value."""
    return (os.environ if environ is None else environ).get(RUN_ID_ENV)


def env_keep_shared_memory(environ: Optional[Mapping[str, str]] = None) -> bool:
    """LM_RESILIENCY_KEEP_SHARED_MEMORY: unset, empty or 0/false/no/off keep nothing; any other
    value keeps the shared-memory slots (read while closing, so it never raises)."""
    text = (os.environ if environ is None else environ).get(KEEP_SHARED_MEMORY_ENV, "").strip()
    return text.lower() not in ("",) + _OFF


def env_resume_step(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP: the optimizer steps a relaunch already completed
    (None when unset or empty); ConfigError naming the variable for anything but digits."""
    return _env_int(os.environ if environ is None else environ, RESUME_STEP_ENV, 0)


def env_log_level(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """LM_RESILIENCY_LOG_LEVEL: the level of the `lm_resiliency` loggers (None when unset or
    empty); ConfigError naming the variable for anything but DEBUG, INFO, WARNING or ERROR (any case)."""
    text = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV, "").strip().upper()
    if not text:
        return None
    if text not in LOG_LEVELS:
        raise ConfigError(f"{LOG_LEVEL_ENV}={text!r}: expected one of {', '.join(LOG_LEVELS)}")
    return text


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> Optional[int]:
    text = env.get(name, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_ENV_DIGITS) or int(text) < minimum:
        raise ConfigError(f"{name}={text!r}: expected an integer >= {minimum} of at most {_MAX_ENV_DIGITS} "
                          "ASCII digits")
    return int(text)
