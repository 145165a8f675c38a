"""The settings every surface reads the same way: `read_settings` (a policy file's or the DeepSpeed
config's `lm_resiliency` section, as `enable_resiliency` keyword arguments) and `ResiliencyPolicy`,
what the zero-code opt-ins enable. It sits beside `attach.py`, above both engines, because one
mapping builds GEMINI's `InMemoryCkptConfig` and SCOUT's `ReplayHarnessConfig`; the variables
themselves are read in `lm_resiliency.config`, the one reader of `LM_RESILIENCY*`."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from lm_resiliency._values import MAX_STEP_INTERVAL, ConfigError
from lm_resiliency.config import ENABLE_ENV, InMemoryCkptConfig, read_policy_environment
from lm_resiliency.files import (CONFIG, Field, RecordRejected, RecordSchema, boolean, check_record, integer,
                                 loads_strict_json, read_file_bytes, text)
from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.scout.config import ReplayHarnessConfig

POLICY_SCHEMA_VERSION = 1
# One bound for every policy file (the opt-in policy and torchrun's worker policy): a real one is
# a few hundred bytes.
POLICY_MAX_BYTES = 1024 * 1024
# A policy file needs two levels (a table of tables); anything much deeper is not a policy.
_MAX_POLICY_DEPTH = 16
_TABLE = Field(types=(dict,), required=False)
# The keys every settings mapping accepts: a policy file, the DeepSpeed config's "lm_resiliency" section.
SETTINGS_FIELDS: Dict[str, Field] = {
    "interval": integer(1, MAX_STEP_INTERVAL, required=False), "checkpoint": _TABLE, "replay": _TABLE,
    "enable_checkpoint": boolean(required=False), "enable_detection": boolean(required=False),
    "recovery_mode": text(choices=tuple(m.value for m in RecoveryMode), required=False)}
SETTINGS_KEYS = tuple(SETTINGS_FIELDS)
SETTINGS_SCHEMA = RecordSchema(what="resiliency settings table", fields=SETTINGS_FIELDS)
POLICY_SCHEMA = RecordSchema(what="policy file", identity=("schema_version", POLICY_SCHEMA_VERSION),
                             fields=SETTINGS_FIELDS, max_bytes=POLICY_MAX_BYTES)
# Checkpoint paths a policy names: read by processes whose working directory the file cannot know.
_POLICY_PATHS = ("disk_folder", "shared_memory_dir")


class SettingsRejected(ConfigError, RecordRejected):
    """A settings document (a policy file, the DeepSpeed config section) or its file is refused;
    the message names the file or section and the field."""


def read_settings(data: Any, where: str, field_prefix: str) -> Dict[str, Any]:
    """Validated `enable_resiliency` keyword arguments from a mapping of `SETTINGS_KEYS`:
    `interval` (int), `checkpoint` / `replay` (tables of InMemoryCkptConfig / ReplayHarnessConfig
    fields), `enable_checkpoint` / `enable_detection` (bool), `recovery_mode` ("latest" or
    "recovery_verified"). Errors are SettingsRejected (a ConfigError): `where` names the mapping,
    `field_prefix + key` the offending field."""
    return settings_values(check_record(data, SETTINGS_SCHEMA, where, error=SettingsRejected), field_prefix)


def settings_values(data: Mapping[str, Any], field_prefix: str) -> Dict[str, Any]:
    """The keyword arguments of a settings mapping already checked against `SETTINGS_FIELDS`
    (extra keys, such as a policy's `schema_version`, are left out)."""
    values: Dict[str, Any] = {key: data[key] for key in ("interval", "enable_checkpoint", "enable_detection")
                              if key in data}
    for key, cls in (("checkpoint", InMemoryCkptConfig), ("replay", ReplayHarnessConfig)):
        if key not in data:
            continue
        table = data[key]
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(table) - known)
        if bad:
            raise SettingsRejected(f"{field_prefix}{key}: unknown {cls.__name__} field(s) {bad}; "
                                   f"accepted: {sorted(known)}")
        if key == "checkpoint":
            _check_paths(table, f"{field_prefix}{key}")
        try:
            values[key] = cls(**table)
        except ConfigError as exc:
            raise SettingsRejected(f"{field_prefix}{key}: {exc}") from None
    # `[checkpoint] enable` and `enable_checkpoint` both switch GEMINI: two answers are a mistake.
    if "enable_checkpoint" in data and "enable" in data.get("checkpoint", {}) \
            and data["checkpoint"]["enable"] != data["enable_checkpoint"]:
        raise SettingsRejected(f"{field_prefix}checkpoint.enable = {str(data['checkpoint']['enable']).lower()} "
                               f"contradicts {field_prefix}enable_checkpoint = "
                               f"{str(data['enable_checkpoint']).lower()}; keep one of them")
    if "recovery_mode" in data:
        values["recovery_mode"] = RecoveryMode(data["recovery_mode"])
    return values


def _check_paths(table: Mapping[str, Any], where: str) -> None:
    for name in _POLICY_PATHS:
        value = table.get(name)
        if isinstance(value, str) and "\0" not in value and not os.path.isabs(value):
            raise SettingsRejected(f"{where}.{name}: must be an absolute path, got {value!r}: a settings file "
                                   "is read by processes whose working directory it cannot know")


def read_policy_file(path: str, where: str) -> bytes:
    """The bytes of the policy file `path`: a regular file (never a link, never a FIFO) of this user
    or root, not writable by group or others (it may name code to import), at most POLICY_MAX_BYTES.
    SettingsRejected naming `where` otherwise."""
    data = read_file_bytes(path, "policy file", max_bytes=POLICY_MAX_BYTES, trust=CONFIG, shown=where,
                           error=SettingsRejected)
    if data is None:
        raise SettingsRejected(f"{where}: no such file exists")
    return data


def parse_policy_document(data: bytes, kind: str, where: str, schema: RecordSchema = POLICY_SCHEMA) -> Dict[str, Any]:
    """A policy file's bytes (`kind` ".toml" or ".json") -> its table, checked against `schema`
    (the version first). SettingsRejected naming `where` and the field otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SettingsRejected(f"{where}: not UTF-8 text: {exc}") from None
    try:
        if kind != ".toml":
            doc = loads_strict_json(text, max_depth=_MAX_POLICY_DEPTH)
        elif sys.version_info >= (3, 11):
            import tomllib

            doc = tomllib.loads(text)
        else:
            raise ImportError("tomllib is in the standard library from Python 3.11")
    except RecursionError:  # tomllib recurses per nested array/inline table
        raise SettingsRejected(f"{where}: nested too deeply to be a policy file") from None
    except ImportError:
        raise SettingsRejected(f"{where}: TOML needs Python 3.11+ (tomllib); write the policy as .json") from None
    except ValueError as exc:  # TOMLDecodeError, JSONDecodeError, duplicate keys, NaN, nesting
        raise SettingsRejected(f"{where}: not valid {kind[1:].upper()}: {exc}") from None
    return check_record(doc, schema, where, error=SettingsRejected)


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
        if not os.path.lexists(path):
            raise SettingsRejected(f"{ENABLE_ENV}={path!r}: expected 1/0 or the path of a policy file (.toml or "
                                   ".json), and no such file exists")
        where = f"policy file {path}"
        kind = os.path.splitext(path)[1].lower()
        if kind not in (".toml", ".json"):
            raise SettingsRejected(f"{ENABLE_ENV}={path!r}: a policy file must end in .toml or .json")
        table = parse_policy_document(read_policy_file(path, where), kind, where)
        return cls(source=path, **settings_values(table, f"{where}: "))

    def arguments(self) -> Dict[str, Any]:
        """The `enable_resiliency` keyword arguments this policy sets (unset ones are left out)."""
        values = {"interval": self.interval, "checkpoint": self.checkpoint, "replay": self.replay,
                  "recovery_mode": self.recovery_mode}
        arguments = {k: v for k, v in values.items() if v is not None}
        for key in ("enable_checkpoint", "enable_detection"):
            if not getattr(self, key):
                arguments[key] = False
        return arguments
