"""Remove GEMINI state of dead runs on this node, on demand.

    python -m lm_resiliency.cleanup [--shared-memory-dir DIR] [--disk-folder DIR ...]
                                    [--older-than AGE] [--dry-run]

A starting job never removes another run's state younger than
`InMemoryCkptConfig.reap_other_runs_after_s` (a relaunch of a crashed job recovers from it); this
command frees it when you know no relaunch is coming. It lists every directory it removes (or,
with --dry-run, would remove) and every one it keeps, with the reason.

- Shared memory (default /dev/shm/lm-resiliency-<uid>): a rank directory is removed when its
  owner process (recorded at attach) is dead and it was last written at least AGE ago. A live
  owner's slots, slots of another boot or PID namespace and directories without a valid owner
  record are never removed.
- Node-local folders (`--disk-folder`, the runs' `disk_folder`): a run's directory is removed when
  no file in it changed for AGE and no live process uses it. Every process that attaches to a run
  records itself in the run's directory (scope, PID, start time), whatever holds its host slots
  (shared memory or `host_memory="heap"`): a live one of this boot and PID namespace keeps the
  run, however the folder is spelled (a symbolic link alias, a relative path) and whichever
  `--shared-memory-dir` is given. A run is also kept while any shared-memory rank directory of its
  run id and topology under that directory is in use. Records of another boot or PID namespace
  cannot be checked here: such a run is judged by AGE alone.

AGE is seconds, or a number with s, m, h or d; the default is 24h, the automatic bound.
`--older-than 0` removes every dead run's state now.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import time
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from lm_resiliency.config import DEFAULT_REAP_OTHER_RUNS_AFTER_S
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.gemini.shm import (NAMESPACE_RE, default_shared_memory_dir, judge_rank_dirs, last_written,
                                      remove_dead_temp_dirs, remove_tree)
from lm_resiliency.gemini.storage import attachment, temp_scope

_DISK_NAMESPACE_RE = re.compile(r"gemini-[0-9a-f]{24}")
_DISK_RANK_RE = re.compile(r"rank-\d{5}")
_AGE_RE = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class CleanupError(ResiliencyError, OSError):
    """A folder to clean cannot be used safely (a symbolic link, another user's, not a directory)."""


@dataclass(frozen=True)
class CleanupItem:
    """One directory the cleanup looked at. `removed`: removed (with dry_run: would be)."""

    path: str
    tier: str       # "shared-memory" or "disk"
    removed: bool
    reason: str
    nbytes: int = 0


def parse_age(text: str) -> float:
    """Seconds from '90', '90s', '30m', '24h' or '7d'."""
    match = _AGE_RE.fullmatch(text.strip().lower())
    if not match:
        raise ValueError(f"--older-than {text!r}: expected seconds or a number with s, m, h or d (e.g. 24h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def cleanup(shared_memory_dir: Optional[str], disk_folders: Iterable[str], older_than_s: float,
            dry_run: bool = False) -> List[CleanupItem]:
    """Remove (or with `dry_run` only list) dead runs' shared-memory slots and node-local
    directories last written at least `older_than_s` ago; see the module documentation."""
    shm_root = os.path.abspath(shared_memory_dir or default_shared_memory_dir())
    items = _clean_shared_memory(shm_root, older_than_s, dry_run)
    for folder in disk_folders:
        items += _clean_disk(os.path.abspath(folder), shm_root, older_than_s, dry_run)
    return items


def _open_private_dir(path: str, parent_fd: Optional[int] = None, name: Optional[str] = None) -> int:
    try:
        fd = os.open(path if name is None else name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise CleanupError(exc.errno, f"cannot open it as a directory without following links: {exc.strerror}",
                           path) from exc
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise CleanupError(f"{path}: owned by uid {st.st_uid}, not by this user; not touching it")
    return fd


def _clean_shared_memory(root: str, older_than_s: float, dry_run: bool) -> List[CleanupItem]:
    if not os.path.lexists(root):
        return []
    items = []
    scope = temp_scope()
    root_fd = _open_private_dir(root)
    try:
        for entry in sorted(os.scandir(root_fd), key=lambda e: e.name):
            if not NAMESPACE_RE.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            ns_path = os.path.join(root, entry.name)
            try:
                ns_fd = _open_private_dir(ns_path, root_fd, entry.name)
            except CleanupError as exc:
                items.append(CleanupItem(ns_path, "shared-memory", False, str(exc)))
                continue
            try:
                for name in remove_dead_temp_dirs(ns_fd, scope, dry_run):
                    items.append(CleanupItem(os.path.join(ns_path, name), "shared-memory", True,
                                             "left half-created or half-removed by a dead process"))
                for verdict in judge_rank_dirs(ns_fd, ns_path, os.geteuid(), scope, older_than_s):
                    if verdict.kind != "stale":
                        reason = (f"{verdict.reason}, younger than {older_than_s:g} s" if verdict.kind == "young"
                                  else verdict.reason)
                        items.append(CleanupItem(verdict.path, "shared-memory", False, reason))
                        continue
                    size = _size(ns_fd, verdict.name)
                    if not dry_run:
                        remove_tree(ns_fd, verdict.name)
                    items.append(CleanupItem(verdict.path, "shared-memory", True, verdict.reason, size))
            finally:
                os.close(ns_fd)
            if not dry_run:
                _rmdir_if_empty(root_fd, entry.name)
    finally:
        os.close(root_fd)
    return items


def _clean_disk(folder: str, shm_root: str, older_than_s: float, dry_run: bool) -> List[CleanupItem]:
    if not os.path.lexists(folder):
        return []
    items = []
    scope = temp_scope()
    folder_fd = _open_private_dir(folder)
    try:
        for entry in sorted(os.scandir(folder_fd), key=lambda e: e.name):
            if not _DISK_NAMESPACE_RE.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            path = os.path.join(folder, entry.name)
            try:
                ns_fd = _open_private_dir(path, folder_fd, entry.name)
            except CleanupError as exc:
                items.append(CleanupItem(path, "disk", False, str(exc)))
                continue
            try:
                holder = _live_attachment(ns_fd) or _shared_memory_holder(shm_root, entry.name, scope)
                if holder is not None:
                    items.append(CleanupItem(path, "disk", False, holder))
                    continue
                ranks = [e.name for e in os.scandir(ns_fd)
                         if _DISK_RANK_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
                age = time.time() - max([last_written(ns_fd)] + [_rank_written(ns_fd, r) for r in ranks])
                if age < older_than_s:
                    items.append(CleanupItem(path, "disk", False, f"last written {age:.0f} s ago, younger than "
                                             f"{older_than_s:g} s"))
                    continue
                size = sum(_size(ns_fd, rank) for rank in ranks)
                if not dry_run:
                    for rank in ranks:
                        remove_tree(ns_fd, rank)
                    for record in [e.name for e in os.scandir(ns_fd) if attachment(e.name) is not None]:
                        os.unlink(record, dir_fd=ns_fd)  # dead (or uncheckable and old) processes
            finally:
                os.close(ns_fd)
            if not dry_run:
                _rmdir_if_empty(folder_fd, entry.name)
            items.append(CleanupItem(path, "disk", True, f"last written {age:.0f} s ago, no live process uses it "
                                     "or holds its shared-memory slots", size))
    finally:
        os.close(folder_fd)
    return items


def _live_attachment(ns_fd: int) -> Optional[str]:
    """Why the run whose node-local namespace is open as `ns_fd` is in use (a live process's
    attachment record), or None."""
    live = [e.name for e in os.scandir(ns_fd) if attachment(e.name) == "live"]
    if not live:
        return None
    pids = sorted({int(name.split("-")[2]) for name in live})
    return f"in use by live process(es) {pids} of this boot and PID namespace"


def _shared_memory_holder(shm_root: str, disk_namespace: str, scope: str) -> Optional[str]:
    """Why the run of `disk_namespace` may still be running (its shared-memory rank directories
    under `shm_root`, for whatever spelling of the disk folder the run used), or None."""
    if not os.path.isdir(shm_root):
        return None
    for name in sorted(os.listdir(shm_root)):
        # <disk namespace>-<hash of the disk folder as the run spelled it>: any spelling counts.
        if not NAMESPACE_RE.fullmatch(name) or name.rsplit("-", 1)[0] != disk_namespace:
            continue
        ns_path = os.path.join(shm_root, name)
        try:
            ns_fd = _open_private_dir(ns_path)
        except CleanupError as exc:
            return f"its shared-memory slots {ns_path} cannot be checked: {exc}"
        try:
            verdicts = judge_rank_dirs(ns_fd, ns_path, os.geteuid(), scope, 0.0)
        finally:
            os.close(ns_fd)
        for verdict in verdicts:
            if verdict.kind in ("live", "foreign", "unattributable"):
                return f"its shared-memory slots {verdict.path} are in use or cannot be checked ({verdict.reason})"
    return None


def _rank_written(ns_fd: int, name: str) -> float:
    fd = os.open(name, _DIR_FLAGS, dir_fd=ns_fd)
    try:
        return last_written(fd)
    finally:
        os.close(fd)


def _size(parent_fd: int, name: str) -> int:
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(fd) if e.is_file(follow_symlinks=False))
    finally:
        os.close(fd)


def _rmdir_if_empty(parent_fd: int, name: str) -> None:
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except OSError:
        pass  # still holds kept directories


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm_resiliency.cleanup",
                                     description="Remove GEMINI shared-memory slots and node-local folders of dead "
                                                 "runs on this node.")
    parser.add_argument("--shared-memory-dir", default=None,
                        help=f"host-slot directory (InMemoryCkptConfig.shared_memory_dir; default "
                             f"{default_shared_memory_dir()})")
    parser.add_argument("--disk-folder", action="append", default=[],
                        help="a node-local folder (InMemoryCkptConfig.disk_folder); repeat for several")
    parser.add_argument("--older-than", default=f"{DEFAULT_REAP_OTHER_RUNS_AFTER_S / 3600:g}h",
                        help="only state last written at least this long ago: seconds, or with s/m/h/d "
                             "(default %(default)s; 0: all dead runs' state)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    args = parser.parse_args(argv)
    try:
        older_than = parse_age(args.older_than)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        items = cleanup(args.shared_memory_dir, args.disk_folder, older_than, dry_run=args.dry_run)
    except CleanupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    verb = "would remove" if args.dry_run else "removed"
    for item in items:
        if item.removed:
            print(f"{verb}: {item.path} ({item.tier}; {item.reason}; {item.nbytes} bytes)")
        else:
            print(f"kept: {item.path} ({item.tier}; {item.reason})")
    freed = sum(item.nbytes for item in items if item.removed)
    print(f"{verb} {sum(item.removed for item in items)} director(ies), {freed} bytes; "
          f"kept {sum(not item.removed for item in items)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
