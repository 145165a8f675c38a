"""The cluster lab itself: hosts that share nothing but the bridge, and real faults between them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lab import leftovers

ALL_REDUCE = """
import os, socket, sys
import torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://h1:29511", rank=rank, world_size=2)
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(socket.gethostname(), rank, value.item(), flush=True)
dist.destroy_process_group()
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""

LISTEN = """
import socket
server = socket.create_server(("0.0.0.0", 29512))
print("listening", flush=True)
while True:
    server.accept()[0].close()
"""


def _env():
    return {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}


def test_gloo_all_reduce_across_two_hosts(make_lab, tmp_path):
    lab = make_lab(["h1", "h2"])
    procs = {name: lab[name].spawn([sys.executable, "-c", ALL_REDUCE, str(rank)], env=_env(),
                                   log=str(tmp_path / f"{name}.log"))
             for rank, name in enumerate(("h1", "h2"))}
    assert [proc.wait(120) for proc in procs.values()] == [0, 0]
    lines = sorted((tmp_path / f"{name}.log").read_text().split()[-3:] for name in procs)
    assert lines == [["h1", "0", "3.0"], ["h2", "1", "3.0"]]


def test_each_host_has_its_own_name_machine_id_shared_memory_and_disk_at_one_path(make_lab):
    lab = make_lab(["h1", "h2"])
    marker = os.path.join(lab.node_local, "mine")
    script = (f"hostname; cat /etc/machine-id; getent hosts h1 h2 | sort; echo $(hostname) > /dev/shm/x; "
              f"echo $(hostname) > {marker}; cat /dev/shm/x {marker}; ip -o -4 addr show eth0 | tr -s ' ' | cut -d' ' -f4")
    seen = {name: lab[name].run(["sh", "-c", script], timeout=30).stdout.split() for name in ("h1", "h2")}
    ids = {seen[name][1] for name in seen}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)
    for name, address in (("h1", "10.231.0.10"), ("h2", "10.231.0.11")):
        out = seen[name]
        assert out[0] == name and out[2:6] == ["10.231.0.10", "h1", "10.231.0.11", "h2"]
        assert out[6:8] == [name, name]  # its own /dev/shm file and its own disk file, not the other's
        assert out[8] == f"{address}/24"
        assert open(os.path.join(lab[name].disk, "mine")).read() == f"{name}\n"
    assert not os.path.exists(marker) and not os.path.exists("/dev/shm/x")  # nothing leaked to this host


def test_crash_kills_every_process_and_shared_memory_keeps_or_wipes_the_disk(make_lab):
    lab = make_lab(["h1", "h2"])
    h1 = lab["h1"]
    h1.run(["sh", "-c", f"echo state > /dev/shm/slot; echo shard > {lab.node_local}/shard"], timeout=30)
    sleepers = [h1.spawn(["sleep", "600"]) for _ in range(3)]
    deadline = time.monotonic() + 30
    while len(h1.processes(lambda p: p.argv[:1] == ["sleep"])) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    h1.crash()
    assert [proc.wait(30) for proc in sleepers] == [-9, -9, -9] and not h1.up
    h1.boot()
    after = h1.run(["sh", "-c", f"ls /dev/shm; cat {lab.node_local}/shard"], timeout=30).stdout
    assert after == "shard\n"  # memory gone, disk kept
    h1.crash(wipe_disk=True)
    h1.boot()
    assert h1.run(["ls", "-A", lab.node_local], timeout=30).stdout == ""


def test_partition_cuts_a_host_off_and_heal_restores_it(make_lab, tmp_path):
    lab = make_lab(["h1", "h2", "h3"])
    server = lab["h2"].spawn([sys.executable, "-u", "-c", LISTEN], log=str(tmp_path / "server.log"))
    deadline = time.monotonic() + 60
    while "listening" not in (tmp_path / "server.log").read_text():
        assert time.monotonic() < deadline and server.poll() is None
        time.sleep(0.1)

    def connect(host):
        return lab[host].run([sys.executable, "-c", CONNECT, "h2", "29512", "2"], timeout=60).stdout.strip()

    assert connect("h1") == "connected"
    lab.partition("h2")
    assert not lab.link_up("h2")
    assert connect("h1") in ("TimeoutError", "timeout")
    lab.heal()
    assert connect("h1") == "connected"
    lab.partition("h2", "h3")  # an island: h3 still reaches h2, h1 does not
    assert connect("h3") == "connected" and connect("h1") in ("TimeoutError", "timeout")
    lab.heal()
    assert connect("h1") == "connected"
    # Traffic stays on the bridge: a host's only route is the lab's subnet.
    routes = lab["h1"].run(["ip", "-4", "route"], timeout=30).stdout.splitlines()
    assert [r.split()[:3] for r in routes] == [["10.231.0.0/24", "dev", "eth0"]]


def test_stopped_process_is_stopped_and_resumes(make_lab):
    lab = make_lab(["h1"])
    proc = lab["h1"].spawn(["sleep", "600"])
    deadline = time.monotonic() + 30
    while not lab["h1"].processes(lambda p: p.argv[:1] == ["sleep"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (sleeper,) = lab["h1"].processes(lambda p: p.argv[:1] == ["sleep"])

    def state():
        with open(f"/proc/{sleeper.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    lab["h1"].stop(sleeper.pid)
    assert state() == "T"
    lab["h1"].resume(sleeper.pid)
    assert state() in ("S", "R")
    lab["h1"].kill(sleeper.pid)
    assert proc.wait(30) == -9


def test_teardown_removes_namespaces_and_a_dead_controllers_leftovers_are_swept(make_lab, tmp_path):
    lab = make_lab(["h1", "h2"])
    names = [lab.switch] + [h.netns for h in lab.hosts.values()]
    lab.teardown()
    assert not set(names) & set(leftovers.namespaces()) and not os.path.exists(lab.work)
    # A controller SIGKILLed with its lab up: its host processes exit on their own, the sweep of the
    # next lab removes its namespaces and directory.
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); from lab import Lab; "
              "lab = Lab(['x1'], parent=sys.argv[2]); lab['x1'].spawn(['sleep', '600']); "
              "print(lab.id, flush=True); time.sleep(600)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", script, root, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    dead_id = child.stdout.readline().strip()
    assert dead_id.startswith("lmrlab-")
    child.kill()
    child.wait(30)
    assert any(n.startswith(dead_id) for n in leftovers.namespaces())
    removed = leftovers.sweep(str(tmp_path))
    assert f"netns {dead_id}-sw" in removed and str(tmp_path / dead_id) in removed
    assert not any(n.startswith(dead_id) for n in leftovers.namespaces())
    deadline = time.monotonic() + 30
    while any(_in_netns_named(dead_id, pid) for pid in os.listdir("/proc") if pid.isdigit()):
        assert time.monotonic() < deadline, "a dead lab's host process survived"
        time.sleep(0.1)


def _in_netns_named(prefix, pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return prefix.encode() in f.read()
    except OSError:
        return False


def test_without_root_the_lab_refuses_to_start_and_says_why(monkeypatch):
    from lab import Lab, LabUnavailable, support

    monkeypatch.setattr(support.os, "geteuid", lambda: 1000)
    support.unavailable_reason.cache_clear()
    try:
        assert support.unavailable_reason() == "the cluster lab needs root (network and mount namespaces)"
        with pytest.raises(LabUnavailable, match="needs root"):
            Lab(["h1"])
    finally:
        support.unavailable_reason.cache_clear()
