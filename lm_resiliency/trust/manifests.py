"""Durable checkpoint manifests: one JSON file per checkpoint id plus ``latest_verified.json``.

Each is published by same-directory temp file, fsync, atomic rename and directory fsync; the
directory is 0700 and files 0600. Reading refuses links, files of another owner, files writable
by group or others, foreign environment ids and anything but the exact schema.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import stat
import time
from typing import Any, List, Optional

from lm_resiliency.files import atomic_write, fsync_dir, loads_strict_json, open_owned
from lm_resiliency.trust.decision import MANIFEST_STATES, RECOVERY_VERIFIED, check_record, is_step
from lm_resiliency.trust.errors import CertificationError, ManifestRejected

logger = logging.getLogger(__name__)

MANIFEST_SCHEMA_VERSION = 1
LATEST_VERIFIED_FILE = "latest_verified.json"

_MANIFEST_KEYS = frozenset({"schema_version", "checkpoint_id", "step", "state", "environment_id",
                            "updated_at", "reason"})
_MANIFEST_RE = re.compile(r"checkpoint-[0-9a-f]{40}\.json")


def manifest_name(checkpoint_id: str) -> str:
    """The manifest file name of a checkpoint id (a hash: ids may contain any character)."""
    return "checkpoint-" + hashlib.sha256(checkpoint_id.encode("utf-8")).hexdigest()[:40] + ".json"


class ManifestStore:
    """JSON manifests of durable checkpoints in one owner-only directory."""

    def __init__(self, directory: str, environment_id: str) -> None:
        self.directory = os.path.abspath(directory)
        self.environment_id = environment_id
        self._uid = os.geteuid()

    # ------------------------------------------------------------ directory

    def ensure_directory(self) -> None:
        """Create the directory 0700 (writer side) and check it is ours and not a link."""
        os.makedirs(os.path.dirname(self.directory), exist_ok=True)
        try:
            os.mkdir(self.directory, 0o700)
        except FileExistsError:
            pass
        self._check_directory(writer=True)

    def _check_directory(self, writer: bool) -> bool:
        try:
            st = os.lstat(self.directory)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            raise ManifestRejected(f"{self.directory}: manifest directory is a symbolic link; refusing to follow it")
        if not stat.S_ISDIR(st.st_mode):
            raise ManifestRejected(f"{self.directory}: manifest directory is not a directory")
        if st.st_uid != self._uid:
            raise ManifestRejected(f"{self.directory}: manifest directory is owned by uid {st.st_uid}, not by "
                                   f"this process (uid {self._uid}); refusing to trust it")
        mode = stat.S_IMODE(st.st_mode)
        if writer and mode != 0o700:
            os.chmod(self.directory, 0o700)
        elif not writer and mode & 0o022:
            raise ManifestRejected(f"{self.directory}: manifest directory is writable by group or others "
                                   f"(mode {mode:o}); refusing to trust it")
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
        fd = open_owned(path, "manifest", ManifestRejected, uid=self._uid, forbidden_mode=0o022)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        try:
            doc = loads_strict_json(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ManifestRejected(f"{path}: manifest is not valid strict JSON ({exc}); refusing to trust it") from exc
        self._validate(doc, path, name)
        return doc

    def _validate(self, doc: Any, path: str, name: str) -> None:
        def bad(reason: str) -> ManifestRejected:
            return ManifestRejected(f"{path}: {reason}; refusing to trust it")

        check_record(doc, _MANIFEST_KEYS, MANIFEST_SCHEMA_VERSION, bad, "manifest ")
        if not isinstance(doc["checkpoint_id"], str) or not doc["checkpoint_id"]:
            raise bad(f"checkpoint_id {doc['checkpoint_id']!r} is not a non-empty string")
        if not is_step(doc["step"]):
            raise bad(f"step {doc['step']!r} is not a non-negative integer")
        if doc["state"] not in MANIFEST_STATES:
            raise bad(f"state {doc['state']!r} is not one of {', '.join(MANIFEST_STATES)}")
        if not isinstance(doc["environment_id"], str):
            raise bad("environment_id is not a string")
        updated = doc["updated_at"]
        if isinstance(updated, bool) or not isinstance(updated, (int, float)) or not math.isfinite(updated):
            raise bad(f"updated_at {updated!r} is not a finite number")
        if not isinstance(doc["reason"], str):
            raise bad("reason is not a string")
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
        if not self._check_directory(writer=False):
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
        if not self._check_directory(writer=False):
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

