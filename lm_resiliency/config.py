"""GEMINI's `InMemoryCkptConfig` (every field validated at construction; errors name the field) and
the one reader of every `LM_RESILIENCY*` variable: the opt-in policy (`ResiliencyPolicy`, with its
policy files and the DeepSpeed config section, `read_settings`) and the variables read whatever
LM_RESILIENCY says (`env_run_id`, `env_keep_shared_memory`, `env_resume_step`). SCOUT's
`ReplayHarnessConfig` is `scout/config.py`."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

# ConfigError, MAX_SECONDS and is_seconds live in _values so SCOUT's config shares them without
# importing this module; they stay importable from here.
from lm_resiliency._values import MAX_SECONDS, ConfigError, is_seconds
from lm_resiliency._values import is_int as _is_int
from lm_resiliency.files import loads_strict_json

_MIB = 1024 * 1024
DEFAULT_REAP_OTHER_RUNS_AFTER_S = 24 * 3600.0


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
    `verify_integrity` checksums every capture once, right after its copy, and checks the bytes
    against that checksum at every hand-off (replica receipt, flush, recovery).
    `check_finite` refuses a capture with NaN or Inf in parameters or optimizer state (the session
    checks those; a direct `save()` checks every floating tensor): it is never published as
    recoverable or certified, and `NonFiniteState` is raised.
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
    reap_other_runs_after_s: float = DEFAULT_REAP_OTHER_RUNS_AFTER_S
    check_finite: bool = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("enable", "verify_integrity", "skip_replication_if_hsdp", "pin_memory", "check_finite"):
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
        _require(self.run_id is None or (isinstance(self.run_id, str) and self.run_id.strip() != ""
                                         and self.run_id.strip().lower() != "none"),
                 name, "run_id", f"must be None or a non-empty string other than 'none' (a placeholder "
                 f"that names no run), got {self.run_id!r}")
        _require(isinstance(self.host_memory, str) and self.host_memory in ("shared", "heap"),
                 name, "host_memory", f"must be 'shared' or 'heap', got {self.host_memory!r}")
        _require(self.shared_memory_dir is None
                 or (isinstance(self.shared_memory_dir, str) and self.shared_memory_dir.strip() != ""),
                 name, "shared_memory_dir",
                 f"must be None (default /dev/shm/lm-resiliency-<uid>) or a non-empty path, "
                 f"got {self.shared_memory_dir!r}")
        _require(is_seconds(self.timeout_s), name, "timeout_s",
                 f"must be a positive, finite number of seconds, at most {MAX_SECONDS:g}, got {self.timeout_s!r}")
        _require(isinstance(self.reap_other_runs_after_s, (int, float))
                 and not isinstance(self.reap_other_runs_after_s, bool)
                 and not math.isnan(self.reap_other_runs_after_s) and self.reap_other_runs_after_s >= 0,
                 name, "reap_other_runs_after_s",
                 f"must be a number of seconds >= 0 (math.inf: never), got {self.reap_other_runs_after_s!r}")


# ------------------------------------------------------------------ settings and the opt-in policy

# The keys every settings mapping accepts: a policy file, the DeepSpeed config's "lm_resiliency" section.
SETTINGS_KEYS = ("interval", "checkpoint", "replay", "enable_checkpoint", "enable_detection", "recovery_mode")
POLICY_SCHEMA_VERSION = 1
# What Accelerate's prepared dataloaders do after a recovery (see lm_resiliency.adapters.accelerate).
DATALOADER_RESUME_MODES = ("auto", "continue", "manual")
ENABLE_ENV = "LM_RESILIENCY"
# A policy file needs two levels (a table of tables); anything much deeper is not a policy.
_MAX_POLICY_DEPTH = 16
# Integer variables: ASCII digits only (int() also takes '1_000' and other scripts' digits), bounded.
_MAX_ENV_DIGITS = 9
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def read_settings(data: Any, where: str, field_prefix: str) -> Dict[str, Any]:
    """Validated `enable_resiliency` keyword arguments from a mapping of `SETTINGS_KEYS`:
    `interval` (int), `checkpoint` / `replay` (tables of InMemoryCkptConfig / ReplayHarnessConfig
    fields), `enable_checkpoint` / `enable_detection` (bool), `recovery_mode` ("latest" or
    "recovery_verified"). Errors are ConfigError: `where` names the mapping, `field_prefix + key`
    the offending field."""
    from lm_resiliency.recovery import RecoveryMode
    from lm_resiliency.scout.config import ReplayHarnessConfig

    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be an object/table, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SETTINGS_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; accepted keys: {list(SETTINGS_KEYS)}")
    values: Dict[str, Any] = {}
    if "interval" in data:
        if not _is_int(data["interval"]) or data["interval"] < 1:
            raise ConfigError(f"{field_prefix}interval: must be a positive int, got {data['interval']!r}")
        values["interval"] = data["interval"]
    for key, cls in (("checkpoint", InMemoryCkptConfig), ("replay", ReplayHarnessConfig)):
        if key not in data:
            continue
        table = data[key]
        if not isinstance(table, dict):
            raise ConfigError(f"{field_prefix}{key}: must be an object/table of {cls.__name__} fields, got {table!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(table) - known)
        if bad:
            raise ConfigError(f"{field_prefix}{key}: unknown {cls.__name__} field(s) {bad}; accepted: {sorted(known)}")
        try:
            values[key] = cls(**table)
        except ConfigError as exc:
            raise ConfigError(f"{field_prefix}{key}: {exc}") from None
    for key in ("enable_checkpoint", "enable_detection"):
        if key in data:
            if not isinstance(data[key], bool):
                raise ConfigError(f"{field_prefix}{key}: must be true or false, got {data[key]!r}")
            values[key] = data[key]
    if "recovery_mode" in data:
        try:
            values["recovery_mode"] = RecoveryMode(data["recovery_mode"])
        except ValueError:
            raise ConfigError(f"{field_prefix}recovery_mode: must be one of {[m.value for m in RecoveryMode]}, "
                              f"got {data['recovery_mode']!r}") from None
    return values


@dataclass(frozen=True)
class ResiliencyPolicy:
    """What the zero-code opt-ins enable (Lightning's `callbacks_factory` entry point, Accelerate's
    launcher bootstrap): the `LM_RESILIENCY*` environment, optionally with a policy file.

    LM_RESILIENCY                      1/true/yes/on: enable; unset/empty/0/false/no/off: inert
                                       (nothing else is read); any other value: a policy file path
    LM_RESILIENCY_INTERVAL             capture (and SCOUT check) every N optimizer steps (default 10)
    LM_RESILIENCY_DIR                  node-local checkpoint folder (checkpoint.disk_folder)
    LM_RESILIENCY_DISK_FLUSH_INTERVAL  flush to it every N steps (checkpoint.disk_flush_interval; 0: never)
    LM_RESILIENCY_SHM_DIR              host-slot directory (checkpoint.shared_memory_dir)
    LM_RESILIENCY_DETECTION            1/0: SCOUT on/off (enable_detection)
    LM_RESILIENCY_DATALOADER_RESUME    Accelerate only: auto, continue or manual
    LM_RESILIENCY_RUN_ID               run identity across restarts (read by GEMINI itself)

    Read whatever LM_RESILIENCY says (`env_run_id`, `env_keep_shared_memory`, `env_resume_step`):
    LM_RESILIENCY_RUN_ID, LM_RESILIENCY_KEEP_SHARED_MEMORY (1: keep shared-memory slots at close)
    and LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP (the fault kit's resume step).

    A policy file (`.toml`, or `.json` with the same structure) is strict and versioned:
    `schema_version = 1` plus any of `SETTINGS_KEYS`; variables that are set override it.
    """

    interval: Optional[int] = None
    checkpoint: Optional[InMemoryCkptConfig] = None
    replay: Any = None  # a ReplayHarnessConfig
    enable_checkpoint: bool = True
    enable_detection: bool = True
    recovery_mode: Any = None  # a RecoveryMode
    resume_dataloaders: Optional[str] = None
    source: Optional[str] = None  # the policy file, if any

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["ResiliencyPolicy"]:
        """The policy `LM_RESILIENCY*` asks for, or None when LM_RESILIENCY is off. Bad values and
        bad policy files raise ConfigError naming the variable, or the file and the field."""
        env = os.environ if environ is None else environ
        switch = env.get(ENABLE_ENV, "").strip()
        if switch.lower() in ("",) + _OFF:
            return None
        policy = cls() if switch.lower() in _ON else cls.from_file(switch)
        values: Dict[str, Any] = {}
        interval = _env_int(env, "LM_RESILIENCY_INTERVAL", 1)
        if interval is not None:
            values["interval"] = interval
        overrides: Dict[str, Any] = {}
        for name, field in (("LM_RESILIENCY_DIR", "disk_folder"), ("LM_RESILIENCY_SHM_DIR", "shared_memory_dir")):
            if env.get(name, "").strip():
                overrides[field] = env[name].strip()
        flush = _env_int(env, "LM_RESILIENCY_DISK_FLUSH_INTERVAL", 0)
        if flush is not None:
            overrides["disk_flush_interval"] = flush
        if overrides:
            values["checkpoint"] = dataclasses.replace(policy.checkpoint or InMemoryCkptConfig(), **overrides)
        detection = env.get("LM_RESILIENCY_DETECTION", "").strip().lower()
        if detection:
            if detection not in _ON + _OFF:
                raise ConfigError(f"LM_RESILIENCY_DETECTION={env['LM_RESILIENCY_DETECTION']!r}: expected 1 "
                                  "(SCOUT on) or 0 (off)")
            values["enable_detection"] = detection in _ON
        resume = env.get("LM_RESILIENCY_DATALOADER_RESUME", "").strip().lower()
        if resume:
            if resume not in DATALOADER_RESUME_MODES:
                raise ConfigError(f"LM_RESILIENCY_DATALOADER_RESUME={resume!r}: expected one of "
                                  f"{DATALOADER_RESUME_MODES}")
            values["resume_dataloaders"] = resume
        return dataclasses.replace(policy, **values)

    @classmethod
    def from_file(cls, path: str) -> "ResiliencyPolicy":
        """A policy file: `schema_version = 1` and any of `SETTINGS_KEYS` (see `read_settings`)."""
        if not os.path.isfile(path):
            problem = "it is not a regular file" if os.path.exists(path) else "no such file exists"
            raise ConfigError(f"{ENABLE_ENV}={path!r}: expected 1/0 or the path of a policy file (.toml or .json), "
                              f"and {problem}")
        where = f"policy file {path}"
        kind = os.path.splitext(path)[1].lower()
        if kind not in (".toml", ".json"):
            raise ConfigError(f"{ENABLE_ENV}={path!r}: a policy file must end in .toml or .json")
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except OSError as exc:
            raise ConfigError(f"{where}: cannot be read: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{where}: not UTF-8 text: {exc}") from None
        try:
            if kind == ".toml":
                import tomllib

                data = tomllib.loads(text)
            else:
                data = loads_strict_json(text, max_depth=_MAX_POLICY_DEPTH)
        except RecursionError:  # tomllib recurses per nested array/inline table
            raise ConfigError(f"{where}: nested too deeply to be a policy file") from None
        except ImportError:
            raise ConfigError(f"{where}: TOML needs Python 3.11+ (tomllib); write the policy as .json") from None
        except ValueError as exc:  # TOMLDecodeError, JSONDecodeError, duplicate keys, NaN, nesting
            raise ConfigError(f"{where}: not valid {kind[1:].upper()}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a table/object at the top level")
        version = data.get("schema_version")
        if not _is_int(version) or version != POLICY_SCHEMA_VERSION:
            raise ConfigError(f"{where}: schema_version: expected {POLICY_SCHEMA_VERSION}, got "
                              f"{'nothing' if version is None else repr(version)}")
        settings = {k: v for k, v in data.items() if k != "schema_version"}
        return cls(source=path, **read_settings(settings, where, f"{where}: "))

    def arguments(self) -> Dict[str, Any]:
        """The `enable_resiliency` keyword arguments this policy sets (unset ones are left out)."""
        values = {"interval": self.interval, "checkpoint": self.checkpoint, "replay": self.replay,
                  "recovery_mode": self.recovery_mode}
        arguments = {k: v for k, v in values.items() if v is not None}
        for key in ("enable_checkpoint", "enable_detection"):
            if not getattr(self, key):
                arguments[key] = False
        return arguments


# Variables read whether or not LM_RESILIENCY is on: by GEMINI (run identity, keeping shared
# memory across a planned stop) and by the fault kit (the step a relaunch resumes after).
RUN_ID_ENV = "LM_RESILIENCY_RUN_ID"
KEEP_SHARED_MEMORY_ENV = "LM_RESILIENCY_KEEP_SHARED_MEMORY"
RESUME_STEP_ENV = "LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"


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


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> Optional[int]:
    text = env.get(name, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_ENV_DIGITS) or int(text) < minimum:
        raise ConfigError(f"{name}={text!r}: expected an integer >= {minimum} of at most {_MAX_ENV_DIGITS} "
                          "ASCII digits")
    return int(text)
