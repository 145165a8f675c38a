"""Whether this machine can run the lab, and the one helper that runs a system command."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache
from typing import List, Optional

TOOLS = ("ip", "unshare", "nsenter", "mount")


class LabUnavailable(RuntimeError):
    """The lab cannot run here (not root, a tool missing, no namespaces); the message says why."""


class LabCommandFailed(RuntimeError):
    """A system command of the lab failed; the message holds the command and its output."""


def run(argv: List[str], *, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run one system command (bounded), raising LabCommandFailed with its output on failure."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise LabCommandFailed(f"{' '.join(argv)}: no answer within {timeout}s") from exc
    if check and done.returncode != 0:
        raise LabCommandFailed(f"{' '.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done


@lru_cache(maxsize=1)
def unavailable_reason() -> Optional[str]:
    """None when the lab can run here, else why not (tests skip with it)."""
    if os.geteuid() != 0:
        return "the cluster lab needs root (network and mount namespaces)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the cluster lab needs {', '.join(missing)} on PATH"
    probe = f"lmrlab-probe-{os.getpid()}"
    try:
        run(["ip", "netns", "add", probe])
    except LabCommandFailed as exc:
        return f"network namespaces are not available here: {exc}"
    try:
        run(["ip", "netns", "exec", probe, "unshare", "--mount", "--uts", "--ipc", "--pid", "--fork",
             "--mount-proc", "--propagation", "private", "true"])
    except LabCommandFailed as exc:
        return f"mount, UTS, IPC or PID namespaces are not available here: {exc}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return None


def require() -> None:
    """Raise LabUnavailable when the lab cannot run here."""
    reason = unavailable_reason()
    if reason is not None:
        raise LabUnavailable(reason)
