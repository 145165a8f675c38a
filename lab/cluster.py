"""The lab: simulated hosts on a private bridge, and the network faults between them.

The bridge lives in a "switch" network namespace of its own; each host's eth0 is one end of a
veth pair whose other end is a port of that bridge. No interface of the lab is in the
controller's namespace and the hosts have no route off the bridge, so lab traffic never leaves
it, and two labs (of this process or another) never see each other even with the same
addresses and ports.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import shutil
import tempfile
import weakref
from typing import Dict, Iterable, List, Optional, Sequence

from lab import leftovers
from lab.host import Host
from lab.support import require, run

logger = logging.getLogger(__name__)

SUBNET = "10.231.0"
_HOST_NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,30}")
_numbers = itertools.count()


class Lab:
    """N simulated hosts (see `lab` for the API). Use as a context manager, or call `teardown()`.

    `hosts` are host names (lower-case letters, digits, '-'); their order gives the addresses
    (SUBNET.10, .11, ...). torch orders rendezvous participants by host name, so the names decide
    which node slot each host gets. `parent` holds the lab's working directory (default: the temp
    directory). `shm_size` bounds each host's /dev/shm. Creating a lab first sweeps what dead labs
    left behind."""

    def __init__(self, hosts: Sequence[str], *, parent: Optional[str] = None, shm_size: str = "2g",
                 boot: bool = True) -> None:
        require()
        names = list(hosts)
        bad = [n for n in names if not _HOST_NAME_RE.fullmatch(n)]
        if bad or len(set(names)) != len(names) or not names:
            raise ValueError(f"Lab(hosts=...): need distinct host names of [a-z0-9-] starting with a letter, "
                             f"got {names}")
        if len(names) > 200:
            raise ValueError(f"Lab(hosts=...): at most 200 hosts, got {len(names)}")
        leftovers.sweep(parent)
        self.id = leftovers.lab_id(next(_numbers))
        self.work = os.path.join(parent or tempfile.gettempdir(), self.id)
        """The lab's working directory (removed at teardown)."""
        self.node_local = os.path.join(self.work, "node-local")
        """The path at which every host sees its own node-local disk (empty outside the hosts)."""
        self.switch = f"{self.id}-sw"
        self.hosts: Dict[str, Host] = {}
        self._ports: Dict[str, str] = {}
        self._islands = 0
        self._torn_down = False
        os.makedirs(self.node_local)
        atexit.register(_teardown_at_exit, weakref.ref(self))
        try:
            run(["ip", "netns", "add", self.switch])
            run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for index, name in enumerate(names):
                self._add_host(index, name, shm_size)
            self._write_hosts_files()
            if boot:
                for host in self.hosts.values():
                    host.boot()
        except BaseException:
            self.teardown()
            raise

    def _add_host(self, index: int, name: str, shm_size: str) -> None:
        netns, port, address = f"{self.id}-h{index}", f"p{index}", f"{SUBNET}.{10 + index}"
        run(["ip", "netns", "add", netns])
        run(["ip", "-n", netns, "link", "set", "lo", "up"])
        run(["ip", "-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch])
        run(["ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0"])
        run(["ip", "-n", netns, "link", "set", "eth0", "up"])
        run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
        run(["ip", "-n", self.switch, "link", "set", port, "up"])
        files = os.path.join(self.work, "hosts", name)
        os.makedirs(files)
        self.hosts[name] = Host(name=name, address=address, netns=netns, files=files, node_local=self.node_local,
                                shm_size=shm_size)
        self._ports[name] = port

    def _write_hosts_files(self) -> None:
        table = "".join(f"{host.address}\t{host.name}\n" for host in self.hosts.values())
        for host in self.hosts.values():
            with open(host.hosts_file, "w") as f:
                f.write(f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n{table}")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # ------------------------------------------------------------------ faults

    def partition(self, *names: str) -> None:
        """Cut `names` off from every other host. One host: its link goes down (a TCP connect
        to or from it then times out; established connections stall). Several: they move to a
        bridge of their own and still reach one another."""
        unknown = [n for n in names if n not in self.hosts]
        if unknown or not names:
            raise ValueError(f"Lab.partition: unknown hosts {unknown} (known: {list(self.hosts)})")
        if len(names) == 1:
            run(["ip", "-n", self.switch, "link", "set", self._ports[names[0]], "down"])
        else:
            self._islands += 1
            bridge = f"br{self._islands}"
            run(["ip", "-n", self.switch, "link", "add", bridge, "type", "bridge"])
            run(["ip", "-n", self.switch, "link", "set", bridge, "up"])
            for name in names:
                run(["ip", "-n", self.switch, "link", "set", self._ports[name], "master", bridge])
        logger.info("lab: partitioned %s", ", ".join(names))

    def heal(self, names: Optional[Iterable[str]] = None) -> None:
        """Reconnect `names` (default: every host) to the one bridge, links up."""
        chosen = list(names) if names is not None else list(self.hosts)
        for name in chosen:
            port = self._ports[name]
            run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
            run(["ip", "-n", self.switch, "link", "set", port, "up"])
        if names is None:
            for index in range(1, self._islands + 1):
                run(["ip", "-n", self.switch, "link", "del", f"br{index}"], check=False)
            self._islands = 0
        logger.info("lab: healed %s", ", ".join(chosen))

    def link_up(self, name: str) -> bool:
        """Whether host `name`'s bridge port is up."""
        shown = run(["ip", "-n", self.switch, "-o", "link", "show", self._ports[name]]).stdout
        return "UP" in shown.partition("<")[2].partition(">")[0].split(",")

    # ------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        """Stop every host (its processes killed), delete the namespaces and the working
        directory. Idempotent; runs at interpreter exit too."""
        if self._torn_down:
            return
        self._torn_down = True
        errors: List[str] = []
        for host in self.hosts.values():
            try:
                host.shutdown()
            except Exception as exc:  # noqa: BLE001 - the rest must still be torn down
                errors.append(f"host {host.name}: {exc}")
            leftovers.kill_namespace_processes(host.netns)
            if run(["ip", "netns", "del", host.netns], check=False).returncode != 0:
                errors.append(f"netns {host.netns} could not be deleted")
        run(["ip", "netns", "del", self.switch], check=False)
        shutil.rmtree(self.work, ignore_errors=True)
        if errors:
            logger.warning("lab %s: teardown problems: %s", self.id, "; ".join(errors))
        logger.info("lab %s: torn down", self.id)


def _teardown_at_exit(ref: "weakref.ReferenceType[Lab]") -> None:
    lab = ref()
    if lab is not None:
        lab.teardown()
