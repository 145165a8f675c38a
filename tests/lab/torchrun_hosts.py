"""torchrun agents on lab hosts, one per host, as users launch them on a cluster: the same
command line on every host (`--rdzv-backend=lm_resiliency` over a TCP store that the agent on
`store_host` serves, the restart context and GEMINI's disk folder on the node-local path every
host mounts its own disk at), the unchanged DDP module examples/torchrun_ddp.py (it never imports
lm_resiliency) and the worker policy that attaches GEMINI (tests/torchrun/launcher.py's, with
`replication_jump = 2`: one host width)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from examples.torchrun.resiliency_cycle.agents import write_plugin
from lab import Lab
from lm_resiliency.integrations.torchrun import TorchrunLaunchConfig
from tests.torchrun import launcher as L

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = "examples.torchrun_ddp"
PORT = 29400
STEPS = 12
# Keep-alive expiry 2 s x 3: a lost host is confirmed gone after 12 s, then a standby joins.
RDZV_CONF = {"keep_alive_interval": "2", "keep_alive_max_attempt": "3", "join_timeout": "300",
             "read_timeout": "120"}

class Run:
    """One training run across lab hosts: `start(host)` launches that host's agent."""

    def __init__(self, lab: Lab, base: str, run_id: str, *, store_host: str, nnodes: str, flush: int = 0,
                 max_restarts: int = 3, rdzv_conf: Optional[Dict[str, str]] = None, scout: str = "") -> None:
        self.lab, self.base, self.run_id = lab, base, run_id
        self.out = os.path.join(base, f"out-{run_id}")
        os.makedirs(self.out, exist_ok=True)
        self.policy = os.path.join(base, f"policy-{run_id}.toml")
        policy = L.POLICY.format(disk=os.path.join(lab.node_local, "gemini")).replace(
            "disk_flush_interval = 0", f"disk_flush_interval = {flush}\nreplication_jump = 2")
        if scout:  # SCOUT's detection on, with these [replay] settings
            policy = policy.replace("enable_detection = false", "enable_detection = true") + scout
        with open(self.policy, "w") as f:
            f.write(policy)
        self.context = os.path.join(lab.node_local, f"ctx-{run_id}", "context.json")
        low, high = (int(n) for n in nnodes.split(":"))
        self.config = TorchrunLaunchConfig(
            run_id=run_id, endpoint=f"{store_host}:{PORT}", restart_context_path=self.context, min_nodes=low,
            max_nodes=high, nproc_per_node=2, max_restarts=max_restarts, store_type="tcp", worker_config=self.policy,
            rdzv_conf=rdzv_conf or RDZV_CONF)
        self.agents: Dict[str, subprocess.Popen] = {}
        self.launch = 0  # relaunches of the run (same --rdzv-id) after every agent stopped
        self._plugin = write_plugin(base)

    def relaunch(self) -> None:
        """The next `start()`s launch the run again (new agents and logs, same run id and paths)."""
        assert all(proc.poll() is not None for proc in self.agents.values()), "agents still run"
        self.launch += 1
        self.agents = {}

    def start(self, host: str, args: Sequence[str] = ()) -> subprocess.Popen:
        command = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.5",
                   *self.config.arguments(["--module", MODULE, self.out, str(STEPS), *args])]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LM_RESILIENCY", "TORCHELASTIC"))}
        env.update({"PYTHONPATH": os.pathsep.join([self._plugin, ROOT]), "OMP_NUM_THREADS": "1",
                    "GLOO_SOCKET_IFNAME": "eth0"})
        proc = self.lab[host].spawn(command, env=env, cwd=ROOT, log=self.log_path(host))
        self.agents[host] = proc
        return proc

    def log_path(self, host: str) -> str:
        return os.path.join(self.base, f"agent-{self.run_id}-{self.launch}-{host}.log")

    def log(self, host: str) -> str:
        with open(self.log_path(host), errors="replace") as f:
            return f.read()

    def logs(self) -> str:
        return "\n".join(f"===== {host} =====\n{self.log(host)[-6000:]}" for host in self.agents)

    def wait_formed(self, hosts: List[str], timeout: float = 300) -> None:
        """Until each of `hosts` wrote its first restart context (the first generation formed)."""
        deadline = time.monotonic() + timeout
        relative = os.path.relpath(self.context, self.lab.node_local)
        while not all(os.path.exists(os.path.join(self.lab[h].disk, relative)) for h in hosts):
            assert time.monotonic() < deadline, f"{hosts} did not form the first generation:\n{self.logs()}"
            time.sleep(0.5)

    def wait_held(self, rank: int, timeout: float = 300) -> None:
        """Until global rank `rank` holds after its kill step (examples/torchrun_ddp.py "hold")."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(os.path.join(self.out, f"held-{rank}")):
            assert time.monotonic() < deadline, f"rank {rank} never reached its hold:\n{self.logs()}"
            time.sleep(0.2)

    def wait_replicas(self, hosts: List[str], step: int, timeout: float = 120) -> None:
        """Until every worker on `hosts` holds the replica of `step` in shared memory (READY sidecar)."""
        script = ("import glob, json; print(json.dumps(sorted(json.load(open(p))['step'] for p in "
                  "glob.glob('/dev/shm/lm-resiliency-*/gemini-*/rank-*/peer_*.json'))))")
        deadline = time.monotonic() + timeout
        for host in hosts:
            while True:
                done = self.lab[host].run([sys.executable, "-c", script], timeout=60)
                if done.returncode == 0 and json.loads(done.stdout).count(step) >= 2:
                    break
                assert time.monotonic() < deadline, f"{host}: no replica of step {step}: {done.stdout} {done.stderr}"
                time.sleep(0.2)

    def wait_shards(self, hosts: List[str], step: int, timeout: float = 120) -> None:
        """Until every worker on `hosts` flushed its own state and its replica of `step` to its disk."""
        name = f"{step:012d}.gemini"
        deadline = time.monotonic() + timeout
        for host in hosts:
            pattern = os.path.join(self.lab[host].disk, "gemini", "gemini-*", "rank-*", f"*-{name}")
            while len(glob.glob(pattern)) < 4:
                assert time.monotonic() < deadline, f"{host}: step {step} not on disk: {glob.glob(pattern)}"
                time.sleep(0.2)

    def wait(self, timeout: float = 600) -> Dict[str, int]:
        """Every agent's exit status (all are killed after `timeout`)."""
        deadline = time.monotonic() + timeout
        codes = {}
        try:
            for host, proc in self.agents.items():
                codes[host] = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agents did not finish within {timeout}s:\n{self.logs()}") from None
        finally:
            self.stop()
        return codes

    def stop_agent(self, host: str, timeout: float = 120) -> int:
        """The operator stops `host`'s agent (SIGTERM, as a scheduler cancelling the job does)."""
        (agent,) = self.lab[host].processes(lambda p: "torch.distributed.run" in p.argv)
        self.lab[host].terminate(agent.pid)
        return self.agents[host].wait(timeout)

    def stop(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)

    def final(self) -> dict:
        """What rank 0 wrote at the end of the run: the step its generation started from and the
        bytes of every parameter and optimizer tensor."""
        names = [n for n in os.listdir(self.out) if n.startswith("final-")]
        assert len(names) == 1, (names, self.logs())
        with open(os.path.join(self.out, names[0])) as f:
            return json.load(f)


def uninterrupted(lab: Lab, base: str, hosts: List[str], store_host: str) -> dict:
    """The final state of a run on `hosts` without faults."""
    run = Run(lab, base, f"baseline-{os.getpid()}-{time.monotonic_ns()}", store_host=store_host,
              nnodes=f"{len(hosts)}:{len(hosts)}")
    for host in hosts:
        run.start(host)
    codes = run.wait(600)
    assert all(code == 0 for code in codes.values()), (codes, run.logs())
    final = run.final()
    assert final["start"] == 0
    return final


def different(resumed: dict, baseline: dict) -> List[str]:
    assert resumed["tensors"].keys() == baseline["tensors"].keys() and len(baseline["tensors"]) == 16
    return [name for name in baseline["tensors"] if resumed["tensors"][name] != baseline["tensors"][name]]
