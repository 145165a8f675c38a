"""The strict worker policy file (`lm_resiliency_worker_config`): `schema_version = 1`, the
`enable_resiliency` settings of `lm_resiliency.settings.read_settings`, and an optional custom
`adapter = "package.module:factory"`. The digest is over the exact bytes, so nodes agree on the
file itself, not on one parse of it."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from lm_resiliency._values import is_int
from lm_resiliency.config import ConfigError
from lm_resiliency.settings import POLICY_SCHEMA_VERSION, read_settings

_MAX_BYTES = 1024 * 1024
_ADAPTER = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class WorkerPolicy:
    """A parsed worker policy: `arguments` are `enable_resiliency` keyword arguments."""

    path: str
    digest: str
    arguments: Dict[str, Any] = field(default_factory=dict)
    adapter: Optional[str] = None


def read_policy_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"worker policy {path}: cannot be read: {exc.strerror or exc}") from None
    if len(data) > _MAX_BYTES:
        raise ConfigError(f"worker policy {path}: larger than {_MAX_BYTES} bytes; not a policy file")
    return data


def policy_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_policy(path: str, data: bytes, expected_digest: Optional[str] = None) -> WorkerPolicy:
    """Validate `data` (the bytes of `path`). With `expected_digest` (the one agreed at
    rendezvous) the bytes must hash to it first. Every error is a ConfigError naming the field."""
    try:
        import tomllib  # type: ignore[import-not-found, unused-ignore]  # Python 3.11+
    except ImportError:
        raise ConfigError(f"worker policy {path}: reading TOML needs Python 3.11+ (tomllib)") from None
    digest = policy_digest(data)
    if expected_digest is not None and digest != expected_digest:
        raise ConfigError(f"worker policy {path}: its contents changed since rendezvous (digest {digest[:12]}, "
                          f"agreed {expected_digest[:12]}); every node must run the same policy file")
    where = f"worker policy {path}"
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{where}: not valid UTF-8 TOML: {exc}") from None
    version = table.pop("schema_version", None)
    if not is_int(version) or version != POLICY_SCHEMA_VERSION:
        raise ConfigError(f"{where}: schema_version: expected {POLICY_SCHEMA_VERSION}, got "
                          f"{'nothing' if version is None else repr(version)}")
    adapter = table.pop("adapter", None)
    if adapter is not None and not (isinstance(adapter, str) and _ADAPTER.fullmatch(adapter)):
        raise ConfigError(f"{where}: adapter: expected \"package.module:factory\", got {adapter!r}")
    return WorkerPolicy(path, digest, read_settings(table, where, f"{where}: "), adapter)
