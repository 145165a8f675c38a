"""Names of what a lab makes, and the sweep that removes what a dead lab left behind.

Every network namespace and working directory of a lab is named
``lmrlab-<controller pid>-<controller start time>-<lab number>[-...]``: the process that made it,
with its kernel start time so a reused PID is not mistaken for it. A lab's host processes die
with the lab's controller on their own (each host's init reads a pipe from it and exits at EOF,
taking its PID namespace along), but named network namespaces and working directories outlive
it. `sweep()` removes those whose controller is gone, and never touches another live lab's.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import tempfile
from typing import List, Optional

from lab.support import run

logger = logging.getLogger(__name__)

PREFIX = "lmrlab"
_NAME_RE = re.compile(rf"{PREFIX}-(?P<pid>\d+)-(?P<start>\d+)-(?P<lab>\d+)(?:-.*)?")


def start_time(pid: int) -> Optional[int]:
    """Kernel start time of `pid` in clock ticks since boot; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def lab_id(number: int) -> str:
    """The name prefix of this process's `number`-th lab."""
    return f"{PREFIX}-{os.getpid()}-{start_time(os.getpid())}-{number}"


def _owner_alive(name: str) -> bool:
    match = _NAME_RE.fullmatch(name)
    if match is None:
        return True  # not ours to judge
    return start_time(int(match.group("pid"))) == int(match.group("start"))


def namespaces() -> List[str]:
    """Every network namespace named like a lab's."""
    listed = run(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    return [name for name in names if _NAME_RE.fullmatch(name)]


def kill_namespace_processes(netns: str) -> None:
    """SIGKILL every process inside network namespace `netns`."""
    pids = run(["ip", "netns", "pids", netns], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep(parent: Optional[str] = None) -> List[str]:
    """Remove the network namespaces (and their processes) and working directories under
    `parent` (default: the temp directory) of labs whose controller process is gone. Returns
    what was removed."""
    removed = []
    for netns in namespaces():
        if _owner_alive(netns):
            continue
        kill_namespace_processes(netns)
        if run(["ip", "netns", "del", netns], check=False).returncode == 0:
            removed.append(f"netns {netns}")
    parent = parent or tempfile.gettempdir()
    try:
        entries = os.listdir(parent)
    except OSError:
        entries = []
    for entry in entries:
        path = os.path.join(parent, entry)
        if _NAME_RE.fullmatch(entry) and not _owner_alive(entry) and os.path.isdir(path) \
                and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("lab: removed leftovers of dead labs: %s", ", ".join(removed))
    return removed
