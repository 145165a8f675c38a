"""Durable checkpoint manifests: one JSON file per checkpoint id plus ``latest_verified.json``.

Each is published by same-directory temp file, fsync, atomic rename and directory fsync; the
directory is 0700 and files 0600. Reading refuses links, files of another owner, files writable
by group or others, foreign environment ids and anything but the exact schema.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from typing import Any, List, Optional

from lm_resiliency.files import (PRIVATE, RecordSchema, atomic_write, check_private_dir, ensure_private_dir, fsync_dir,
                                 integer, number, read_record, text)
from lm_resiliency.trust.decision import MANIFEST_STATES, RECOVERY_VERIFIED
from lm_resiliency.trust.errors import CertificationError, ManifestRejected

logger = logging.getLogger(__name__)

MANIFEST_SCHEMA_VERSION = 1
LATEST_VERIFIED_FILE = "latest_verified.json"

MANIFEST_SCHEMA = RecordSchema(
    what="durable checkpoint manifest", identity=("schema_version", MANIFEST_SCHEMA_VERSION),
    fields={"checkpoint_id": text(max_length=None), "step": integer(0), "state": text(choices=MANIFEST_STATES),
            "environment_id": text(nonempty=False, max_length=None), "updated_at": number(),
            "reason": text(nonempty=False, max_length=None)})
_MANIFEST_RE = re.compile(r"checkpoint-[0-9a-f]{40}\.json")


def manifest_name(checkpoint_id: str) -> str:
    """The manifest file name of a checkpoint id (a hash: ids may contain any character)."""
    return "checkpoint-" + hashlib.sha256(checkpoint_id.encode("utf-8")).hexdigest()[:40] + ".json"


class ManifestStore:
    """JSON manifests of durable checkpoints in one owner-only directory."""

    def __init__(self, directory: str, environment_id: str) -> None:
        self.directory = os.path.abspath(directory)
        self.environment_id = environment_id

    # ------------------------------------------------------------ directory

    def ensure_directory(self) -> None:
        """Create the directory 0700 (writer side) and check it is ours and not a link."""
        ensure_private_dir(self.directory, "manifest directory", error=ManifestRejected)

    def _check_directory(self) -> bool:
        """Whether the directory exists (ManifestRejected when it is not private to this user)."""
        if not os.path.lexists(self.directory):
            return False
        check_private_dir(self.directory, "manifest directory", error=ManifestRejected)
        return True

    # ------------------------------------------------------------ write

    def _publish(self, name: str, doc: dict) -> None:
        data = json.dumps(doc, sort_keys=True, allow_nan=False, indent=1).encode("utf-8") + b"\n"
        atomic_write(os.path.join(self.directory, name), data)

    def write(self, checkpoint_id: str, step: int, state: str, reason: str = "") -> dict:
        """Publish the manifest of `checkpoint_id`; a RECOVERY_VERIFIED one also becomes the
        ``latest_verified.json`` pointer (after its own manifest)."""
        doc = {"schema_version": MANIFEST_SCHEMA_VERSION, "checkpoint_id": checkpoint_id, "step": step,
               "state": state, "environment_id": self.environment_id, "updated_at": time.time(),
               "reason": reason}
        self._publish(manifest_name(checkpoint_id), doc)
        if state == RECOVERY_VERIFIED:
            self._publish(LATEST_VERIFIED_FILE, doc)
        logger.info("durable checkpoint %r (step %d) is %s%s", checkpoint_id, step, state,
                    f": {reason}" if reason else "")
        return doc

    def refresh_pointer(self) -> None:
        """Point ``latest_verified.json`` at the newest RECOVERY_VERIFIED manifest (or remove it)."""
        verified = [d for d in self.scan() if d["state"] == RECOVERY_VERIFIED]
        path = os.path.join(self.directory, LATEST_VERIFIED_FILE)
        if verified:
            self._publish(LATEST_VERIFIED_FILE, max(verified, key=lambda d: (d["step"], d["updated_at"])))
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            fsync_dir(self.directory)

    # ------------------------------------------------------------ read

    def read(self, name: str) -> Optional[dict]:
        """One validated manifest, or None if the file does not exist."""
        path = os.path.join(self.directory, name)
        doc = read_record(path, MANIFEST_SCHEMA, trust=PRIVATE, error=ManifestRejected)
        if doc is not None:
            self._validate(doc, path, name)
        return doc

    def _validate(self, doc: Any, path: str, name: str) -> None:
        def bad(reason: str) -> ManifestRejected:
            return ManifestRejected(f"{path}: {reason}; refusing to trust it")

        if doc["environment_id"] != self.environment_id:
            raise bad(f"written for environment {doc['environment_id']!r}, but this job's environment_id is "
                      f"{self.environment_id!r}")
        if name == LATEST_VERIFIED_FILE:
            if doc["state"] != RECOVERY_VERIFIED:
                raise bad(f"the latest-verified pointer has state {doc['state']!r}")
        elif name != manifest_name(doc["checkpoint_id"]):
            raise bad(f"file name does not match checkpoint_id {doc['checkpoint_id']!r} "
                      f"(expected {manifest_name(doc['checkpoint_id'])})")

    def scan(self) -> List[dict]:
        """Every checkpoint manifest (pointer excluded), validated; [] if the directory is missing."""
        if not self._check_directory():
            return []
        docs = []
        for name in sorted(os.listdir(self.directory)):
            if _MANIFEST_RE.fullmatch(name):
                doc = self.read(name)
                if doc is not None:
                    docs.append(doc)
        return docs

    def newest_verified(self) -> dict:
        """The newest RECOVERY_VERIFIED manifest; never a candidate or quarantined one."""
        if not self._check_directory():
            raise CertificationError(f"no RECOVERY_VERIFIED durable checkpoint: manifest directory "
                                     f"{self.directory} does not exist")
        docs = self.scan()
        verified = [d for d in docs if d["state"] == RECOVERY_VERIFIED]
        if not verified:
            states = ", ".join(f"{d['checkpoint_id']!r}@{d['step']}={d['state']}" for d in docs) or "none"
            raise CertificationError(f"no RECOVERY_VERIFIED durable checkpoint in {self.directory} for "
                                     f"environment {self.environment_id!r} (manifests: {states}); refusing to "
                                     "load a candidate or quarantined checkpoint")
        newest = max(verified, key=lambda d: (d["step"], d["updated_at"]))
        pointer = self.read(LATEST_VERIFIED_FILE)
        if pointer is not None:
            target = next((d for d in docs if d["checkpoint_id"] == pointer["checkpoint_id"]), None)
            if target is None or target["state"] != RECOVERY_VERIFIED or target["step"] != pointer["step"]:
                found = "missing" if target is None else f"{target['state']} at step {target['step']}"
                raise ManifestRejected(
                    f"{os.path.join(self.directory, LATEST_VERIFIED_FILE)}: names checkpoint "
                    f"{pointer['checkpoint_id']!r} at step {pointer['step']}, but its manifest is {found}; "
                    "refusing ambiguous trust")
            if target["checkpoint_id"] != newest["checkpoint_id"]:
                logger.warning("latest_verified.json names %r (step %d) but %r (step %d) is newer and "
                               "RECOVERY_VERIFIED (a publication was interrupted); using the newer one",
                               target["checkpoint_id"], target["step"], newest["checkpoint_id"], newest["step"])
        return newest

