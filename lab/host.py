"""One simulated host of the lab: its own network stack, host name, machine id, /dev/shm,
node-local disk and processes.

A host is a network namespace (made by the lab, wired to its switch) plus an *init*: a process
started as ``ip netns exec NS unshare --mount --uts --ipc --pid --fork --mount-proc`` that sets
the host name, bind-mounts the host's hosts file on /etc/hosts and its machine id on
/etc/machine-id, mounts a fresh tmpfs on /dev/shm, bind-mounts the host's disk directory on the
lab's common node-local path, and then waits on a pipe from the lab's controller. Every process
of the host is started with ``nsenter`` into the init's namespaces, so it sees the host's files
and is a member of the host's PID namespace.

The init is PID 1 of that namespace: killing it (a crash) makes the kernel SIGKILL every process
of the host, and the tmpfs goes away with the last process of the mount namespace. When the
controller dies, even by SIGKILL, the pipe reaches EOF and the init exits: the host's processes
never outlive the lab.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from lab.support import LabCommandFailed

logger = logging.getLogger(__name__)

_INIT_SCRIPT = """set -e
hostname "$1"
mount --bind "$2" /etc/hosts
if [ -e /etc/machine-id ]; then mount --bind "$3" /etc/machine-id; fi
mount -t tmpfs -o mode=1777,size="$6" tmpfs /dev/shm
mount --bind "$4" "$5"
echo ready
exec cat >/dev/null
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostProcess:
    """A process of a host as the controller sees it (PIDs are the controller's)."""

    pid: int
    """PID in the controller's PID namespace (what `os.kill` takes here)."""
    argv: List[str]
    """Its command line."""
    environ: Dict[str, str]
    """Its environment at start (e.g. RANK, LOCAL_RANK of a torchrun worker)."""


class Host:
    """A simulated host; made by `Lab`, which names its address and files."""

    def __init__(self, *, name: str, address: str, netns: str, files: str, node_local: str,
                 shm_size: str) -> None:
        self.name = name
        """The host name, resolving to `address` on every host of the lab."""
        self.address = address
        """The host's address on the lab's bridge (on its eth0)."""
        self.netns = netns
        """The host's network namespace."""
        self.disk = os.path.join(files, "disk")
        """The host's node-local disk as the controller sees it (mounted at `Lab.node_local` inside)."""
        self.machine_id_file = os.path.join(files, "machine-id")
        self.hosts_file = os.path.join(files, "hosts")
        self._files = files
        self._node_local = node_local
        self._shm_size = shm_size
        self._init: Optional[subprocess.Popen] = None
        self._init_pid: Optional[int] = None
        self._namespaces: Dict[str, str] = {}
        self._spawned: List[subprocess.Popen] = []
        os.makedirs(self.disk, exist_ok=True)
        with open(self.machine_id_file, "w") as f:
            f.write(os.urandom(16).hex() + "\n")

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, {'up' if self.up else 'down'})"

    # ------------------------------------------------------------------ lifecycle

    @property
    def up(self) -> bool:
        """Whether the host runs (booted and not crashed)."""
        return self._init is not None and self._init.poll() is None

    def boot(self, timeout: float = 30.0) -> None:
        """Start the host: fresh mount, UTS, IPC and PID namespaces (an empty /dev/shm), its disk
        as it was left. The network namespace, address and disk persist across crashes."""
        if self.up:
            raise RuntimeError(f"host {self.name} is already up")
        log = open(os.path.join(self._files, "init.log"), "ab")
        try:
            self._init = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--uts", "--ipc", "--pid", "--fork",
                 "--mount-proc", "--propagation", "private", "sh", "-c", _INIT_SCRIPT, "sh", self.name,
                 self.hosts_file, self.machine_id_file, self.disk, self._node_local, self._shm_size],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        finally:
            log.close()
        line = self._read_ready(timeout)
        if line != b"ready\n":
            self._kill_init()
            with open(os.path.join(self._files, "init.log"), errors="replace") as f:
                raise LabCommandFailed(f"host {self.name} did not start: {f.read()[-2000:]}")
        self._init_pid = self._child_of(self._init.pid)
        self._namespaces = {kind: os.readlink(f"/proc/{self._init_pid}/ns/{kind}") for kind in ("pid", "mnt")}
        logger.info("lab: host %s up (%s, init pid %d)", self.name, self.address, self._init_pid)

    def _read_ready(self, timeout: float) -> bytes:
        assert self._init is not None and self._init.stdout is not None
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self._init.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return b""
        return self._init.stdout.readline()

    @staticmethod
    def _child_of(pid: int) -> int:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        if len(children) != 1:
            raise LabCommandFailed(f"host init {pid} has children {children}, expected one")
        return int(children[0])

    def crash(self, *, wipe_disk: bool = False, timeout: float = 30.0) -> None:
        """Power loss: every process of the host SIGKILLed at once, its /dev/shm gone; its disk
        kept, or emptied with `wipe_disk`. `boot()` brings it back (same name, address, disk)."""
        self._kill_init()
        self._wait_empty(timeout)
        if wipe_disk:
            for entry in os.listdir(self.disk):
                path = os.path.join(self.disk, entry)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
        logger.info("lab: host %s crashed%s", self.name, " (disk wiped)" if wipe_disk else "")

    def _kill_init(self) -> None:
        if self._init_pid is not None:
            try:
                os.kill(self._init_pid, signal.SIGKILL)  # PID 1 of the host: the kernel kills the rest
            except ProcessLookupError:
                pass
        # The nsenter waiting for each started program goes too: one that mirrored its program's
        # SIGSTOP would never reap it, and the dead host's PID namespace would never finish.
        for proc in self._spawned:
            if proc.poll() is None:
                proc.kill()
        if self._init is not None:
            if self._init.poll() is None:
                self._init.kill()
            self._init.wait(30)
            for stream in (self._init.stdin, self._init.stdout):
                if stream is not None:
                    stream.close()

    def _wait_empty(self, timeout: float) -> None:
        """Until no process is left in the host's PID or mount namespace (the tmpfs is gone)."""
        deadline = time.monotonic() + timeout
        while True:
            for proc in self._spawned:
                proc.poll()  # reap: a zombie nsenter holds nothing, but its parent must collect it
            left = self._members(("pid", "mnt"))
            if not left:
                return
            if time.monotonic() >= deadline:
                raise LabCommandFailed(f"host {self.name}: processes {left} survived the crash")
            time.sleep(0.05)

    def _members(self, kinds: Sequence[str]) -> List[int]:
        if not self._namespaces:
            return []
        members = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            for kind in kinds:
                try:
                    if os.readlink(f"/proc/{entry}/ns/{kind}") == self._namespaces[kind]:
                        members.append(int(entry))
                        break
                except OSError:
                    continue
        return members

    def shutdown(self) -> None:
        """Stop the host for good (teardown): like a crash, the disk left as it is."""
        if self._init is None:
            return
        try:
            self.crash()
        finally:
            for proc in self._spawned:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(30)
            self._spawned = []
            self._init = None
            self._init_pid = None

    # ------------------------------------------------------------------ processes

    def spawn(self, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
              log: Optional[str] = None) -> subprocess.Popen:
        """Start `argv` on the host (its namespaces, the host's PID namespace), output to `log`
        (default: discarded). `env` defaults to the controller's environment. The returned Popen
        is the `nsenter` that waits for it: its exit status is the program's (a SIGKILLed program
        gives -9)."""
        if not self.up or self._init_pid is None:
            raise RuntimeError(f"host {self.name} is not up")
        command = ["nsenter", f"--target={self._init_pid}", "--mount", "--uts", "--ipc", "--net", "--pid",
                   f"--wd={cwd or os.getcwd()}", "--", *argv]
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(command, env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        self._spawned.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float, env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run `argv` on the host to completion (killed after `timeout`); output captured."""
        if not self.up or self._init_pid is None:
            raise RuntimeError(f"host {self.name} is not up")
        command = ["nsenter", f"--target={self._init_pid}", "--mount", "--uts", "--ipc", "--net", "--pid",
                   f"--wd={cwd or os.getcwd()}", "--", *argv]
        return subprocess.run(command, env=dict(env) if env is not None else None, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def processes(self, match: Optional[Callable[[HostProcess], bool]] = None) -> List[HostProcess]:
        """The host's live processes (the init excluded), those `match` accepts."""
        found = []
        for pid in self._members(("pid",)):
            if pid == self._init_pid:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
                with open(f"/proc/{pid}/environ", "rb") as f:
                    pairs = [part.decode(errors="replace").partition("=") for part in f.read().split(b"\0") if part]
            except OSError:
                continue
            process = HostProcess(pid=pid, argv=argv, environ={k: v for k, _, v in pairs})
            if match is None or match(process):
                found.append(process)
        return found

    def workers(self) -> Dict[int, HostProcess]:
        """The host's torchrun workers by global rank (processes whose environment has RANK and
        TORCHELASTIC_RESTART_COUNT)."""
        workers = self.processes(lambda p: "RANK" in p.environ and "TORCHELASTIC_RESTART_COUNT" in p.environ)
        return {int(p.environ["RANK"]): p for p in workers}

    def stop(self, pid: int, timeout: float = 10.0) -> None:
        """SIGSTOP one process of the host (a hang: it holds its sockets and answers nothing);
        returns once it is stopped."""
        self._signal(pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while _state(pid) not in ("T", None):
            if time.monotonic() >= deadline:
                raise LabCommandFailed(f"host {self.name}: pid {pid} did not stop within {timeout}s")
            time.sleep(0.01)

    def resume(self, pid: int) -> None:
        """SIGCONT a stopped process (and the nsenter that started it, which stops along with
        its program)."""
        self._signal(pid, signal.SIGCONT)
        parent = _parent(pid)
        if parent is not None and parent in {proc.pid for proc in self._spawned}:
            os.kill(parent, signal.SIGCONT)

    def kill(self, pid: int) -> None:
        """SIGKILL one process of the host."""
        self._signal(pid, signal.SIGKILL)

    def terminate(self, pid: int) -> None:
        """SIGTERM one process of the host (an operator stopping a job)."""
        self._signal(pid, signal.SIGTERM)

    def _signal(self, pid: int, signum: int) -> None:
        if pid not in self._members(("pid",)):
            raise ValueError(f"pid {pid} is not a process of host {self.name}")
        os.kill(pid, signum)


def _stat_fields(pid: int) -> Optional[List[str]]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def _state(pid: int) -> Optional[str]:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _parent(pid: int) -> Optional[int]:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None
