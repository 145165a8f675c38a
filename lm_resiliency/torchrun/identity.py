"""Node identity for the torchrun backend: a hash of the machine id, never the raw id."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Optional

from lm_resiliency.files import INPUT, RecordRejected, read_file_bytes

MACHINE_ID_ENV = "LM_RESILIENCY_MACHINE_ID_PATH"
DEFAULT_MACHINE_ID_PATH = "/etc/machine-id"
# systemd's format: 32 lowercase hex digits (machine-id(5)).
_MACHINE_ID = re.compile(r"[0-9a-f]{32}")


def read_machine_id(path: Optional[str] = None) -> str:
    """The machine id in `path` (default: $LM_RESILIENCY_MACHINE_ID_PATH, else /etc/machine-id).
    Raises ValueError naming the file when it is missing, relative or not a machine id."""
    where = path or os.environ.get(MACHINE_ID_ENV, "").strip() or DEFAULT_MACHINE_ID_PATH
    if not os.path.isabs(where):
        raise ValueError(f"{MACHINE_ID_ENV}={where!r}: must be an absolute path to a machine-id file")
    try:
        # The administrator's file (often a link or bind mount): a regular file, never a FIFO.
        data = read_file_bytes(where, "machine id file", max_bytes=256, trust=INPUT)
    except RecordRejected as exc:
        raise ValueError(f"cannot read the machine id from {where}: {exc}; set {MACHINE_ID_ENV} to a file holding "
                         "this node's machine id") from None
    if data is None:
        raise ValueError(f"cannot read the machine id from {where}: no such file; set {MACHINE_ID_ENV} to a file "
                         "holding this node's machine id")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        text = ""
    if not _MACHINE_ID.fullmatch(text):
        raise ValueError(f"{where} does not hold a machine id (32 lowercase hex digits, machine-id(5))")
    return text


def derive_torchrun_node_id(machine_id: Optional[str] = None) -> str:
    """This node's stable torchrun identity: a SHA-256 of its machine id (read as `read_machine_id`
    does when not given), 32 hex digits. The raw machine id never leaves the node."""
    raw = read_machine_id() if machine_id is None else machine_id
    if not _MACHINE_ID.fullmatch(raw):
        raise ValueError("derive_torchrun_node_id: expected a machine id of 32 lowercase hex digits")
    return hashlib.sha256(b"lm-resiliency-torchrun-node\0" + raw.encode("ascii")).hexdigest()[:32]
