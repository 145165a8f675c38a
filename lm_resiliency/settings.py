"""The settings every surface reads the same way: `read_settings` (a policy file's or the DeepSpeed
config's `lm_resiliency` section, as `enable_resiliency` keyword arguments) and `ResiliencyPolicy`,
what the zero-code opt-ins enable. It sits beside `attach.py`, above both engines, because one
mapping builds GEMINI's `InMemoryCkptConfig` and SCOUT's `ReplayHarnessConfig`; the variables
themselves are read in `lm_resiliency.config`, the one reader of `LM_RESILIENCY*`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from lm_resiliency._values import is_int
from lm_resiliency.config import ENABLE_ENV, ConfigError, InMemoryCkptConfig, read_policy_environment
from lm_resiliency.files import loads_strict_json
from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.scout.config import ReplayHarnessConfig

# The keys every settings mapping accepts: a policy file, the DeepSpeed config's "lm_resiliency" section.
SETTINGS_KEYS = ("interval", "checkpoint", "replay", "enable_checkpoint", "enable_detection", "recovery_mode")
POLICY_SCHEMA_VERSION = 1
# A policy file needs two levels (a table of tables); anything much deeper is not a policy.
_MAX_POLICY_DEPTH = 16


def read_settings(data: Any, where: str, field_prefix: str) -> Dict[str, Any]:
    """Validated `enable_resiliency` keyword arguments from a mapping of `SETTINGS_KEYS`:
    `interval` (int), `checkpoint` / `replay` (tables of InMemoryCkptConfig / ReplayHarnessConfig
    fields), `enable_checkpoint` / `enable_detection` (bool), `recovery_mode` ("latest" or
    "recovery_verified"). Errors are ConfigError: `where` names the mapping, `field_prefix + key`
    the offending field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be an object/table, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SETTINGS_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; accepted keys: {list(SETTINGS_KEYS)}")
    values: Dict[str, Any] = {}
    if "interval" in data:
        if not is_int(data["interval"]) or data["interval"] < 1:
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

    Read whatever LM_RESILIENCY says (`lm_resiliency.config`'s `env_run_id`,
    `env_keep_shared_memory`, `env_resume_step`): LM_RESILIENCY_RUN_ID,
    LM_RESILIENCY_KEEP_SHARED_MEMORY (1: keep shared-memory slots at close) and
    LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP (the fault kit's resume step).

    A policy file (`.toml`, or `.json` with the same structure) is strict and versioned:
    `schema_version = 1` plus any of `SETTINGS_KEYS`; variables that are set override it.
    """

    interval: Optional[int] = None
    checkpoint: Optional[InMemoryCkptConfig] = None
    replay: Optional[ReplayHarnessConfig] = None
    enable_checkpoint: bool = True
    enable_detection: bool = True
    recovery_mode: Optional[RecoveryMode] = None
    resume_dataloaders: Optional[str] = None
    source: Optional[str] = None  # the policy file, if any

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["ResiliencyPolicy"]:
        """The policy `LM_RESILIENCY*` asks for, or None when LM_RESILIENCY is off. Bad values and
        bad policy files raise ConfigError naming the variable, or the file and the field."""
        env = read_policy_environment(environ)
        if env is None:
            return None
        policy = cls() if env.policy_file is None else cls.from_file(env.policy_file)
        values: Dict[str, Any] = {}
        if env.interval is not None:
            values["interval"] = env.interval
        if env.checkpoint:
            values["checkpoint"] = dataclasses.replace(policy.checkpoint or InMemoryCkptConfig(), **env.checkpoint)
        if env.enable_detection is not None:
            values["enable_detection"] = env.enable_detection
        if env.resume_dataloaders is not None:
            values["resume_dataloaders"] = env.resume_dataloaders
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
        if not is_int(version) or version != POLICY_SCHEMA_VERSION:
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
