"""The cluster lab: N simulated hosts on one machine, for tests, the resiliency cycle and benchmarks.

Each host has what a real cluster node has and a process on one host cannot reach on another:
its own network stack and address on a private bridge (`eth0`), its own host name resolving to
that address on every host (UTS namespace plus a hosts file on /etc/hosts), its own machine id
(/etc/machine-id), its own /dev/shm (a tmpfs that dies with the host), its own node-local disk
mounted at the *same path* on every host (`Lab.node_local`, so one worker policy serves all), and
its own PID namespace. Faults are real events: a crash SIGKILLs every process of the host and
takes its /dev/shm along; a partition takes its link down; a stopped process holds its sockets
and answers nothing. Needs root (tests skip with `unavailable_reason()` otherwise). Not shipped
in the wheel: it is test and benchmark infrastructure, importable from the repository root like
`benchmarks` and `examples`.

    from lab import Lab

    with Lab(["h1", "h2", "h3"]) as lab:                 # hosts up, all on one bridge
        h1 = lab["h1"]                                      # Host: name, address, disk, netns
        agent = h1.spawn(["python", "-m", "torch.distributed.run", ...],
                         env={..., "GLOO_SOCKET_IFNAME": "eth0"}, cwd=repo, log="/tmp/h1.log")
        h1.workers()                                        # {global rank: HostProcess} of torchrun workers
        h1.stop(h1.workers()[0].pid)                        # SIGSTOP (a hang); resume, kill, terminate
        lab.partition("h2")                                 # h2's link down; partition("h2", "h3"): an island
        lab.heal()                                          # every link back
        lab["h3"].crash(wipe_disk=False)                    # all processes SIGKILLed, /dev/shm gone
        lab["h3"].boot()                                    # back with the disk it had
    # teardown: processes, namespaces, mounts and the working directory are gone

The lab tears down what it made at `teardown()` / the end of the `with` block / interpreter exit;
if its controller is SIGKILLed, every host process still dies (each host's init exits when the
controller's pipe closes) and the next lab sweeps the leftover namespaces and directories by
their name prefix (`lab.leftovers`), never another live lab's.

Inside the hosts, torchrun advertises `socket.getfqdn()` (the host name) in its rendezvous and
as the workers' MASTER_ADDR, which the hosts files resolve to lab addresses; gloo needs
`GLOO_SOCKET_IFNAME=eth0`. Processes see the controller's file system otherwise (the repository,
/tmp), as a shared file system.
"""

from lab.cluster import SUBNET, Lab
from lab.host import Host, HostProcess
from lab.leftovers import sweep
from lab.support import LabCommandFailed, LabUnavailable, unavailable_reason

__all__ = ["Host", "HostProcess", "Lab", "LabCommandFailed", "LabUnavailable", "SUBNET", "sweep",
           "unavailable_reason"]
