"""The strict worker policy file (`lm_resiliency_worker_config`): `schema_version = 1`, the
`enable_resiliency` settings of `lm_resiliency.settings.read_settings`, and an optional custom
`adapter = "package.module:factory"`. Read and checked by settings' one policy reader (file trust,
size bound, version); the digest is over the exact bytes, so nodes agree on the file itself, not
on one parse of it."""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from lm_resiliency.files import RecordSchema, text
from lm_resiliency.settings import (POLICY_SCHEMA, SettingsRejected, parse_policy_document, read_policy_file,
                                    settings_values)

_ADAPTER = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
WORKER_POLICY_SCHEMA = RecordSchema(what="worker policy", identity=POLICY_SCHEMA.identity,
                                    fields={**POLICY_SCHEMA.fields, "adapter": text(max_length=256, required=False)},
                                    max_bytes=POLICY_SCHEMA.max_bytes)


@dataclass(frozen=True)
class WorkerPolicy:
    """A parsed worker policy: `arguments` are `enable_resiliency` keyword arguments."""

    path: str
    digest: str
    arguments: Dict[str, Any] = field(default_factory=dict)
    adapter: Optional[str] = None


def read_policy_bytes(path: str) -> bytes:
    """The bytes of the worker policy `path` (refused at once when it is a FIFO, a link, writable by
    group or others, or another user's; see `lm_resiliency.settings.read_policy_file`)."""
    return read_policy_file(path, f"worker policy {path}")


def policy_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_policy(path: str, data: bytes, expected_digest: Optional[str] = None) -> WorkerPolicy:
    """Validate `data` (the bytes of `path`). With `expected_digest` (the one agreed at
    rendezvous) the bytes must hash to it first. Every error is a ConfigError naming the field."""
    digest = policy_digest(data)
    if expected_digest is not None and digest != expected_digest:
        raise SettingsRejected(f"worker policy {path}: its contents changed since rendezvous (digest {digest[:12]}, "
                               f"agreed {expected_digest[:12]}); every node must run the same policy file")
    where = f"worker policy {path}"
    table = parse_policy_document(data, ".toml", where, WORKER_POLICY_SCHEMA)
    adapter = table.get("adapter")
    if adapter is not None:
        if not _ADAPTER.fullmatch(adapter):
            raise SettingsRejected(f"{where}: adapter: expected \"package.module:factory\", got {adapter!r}")
        # A factory of the standard library ("os:system") is never a stack adapter, only a way to run code.
        if adapter.split(".", 1)[0].split(":", 1)[0] in (*sys.stdlib_module_names, "builtins"):
            raise SettingsRejected(f"{where}: adapter: {adapter!r} names the standard library; an adapter is a "
                                   "factory of your training stack (\"package.module:factory\")")
    return WorkerPolicy(path, digest, settings_values(table, f"{where}: "), adapter)
