"""Real `python -m torch.distributed.run` agents on this host, one per synthetic node: each with
its own machine-id file, restart-context directory and log, one worker, `--rdzv-backend=lm_resiliency`
over a file store, and the worker policy that attaches GEMINI and SCOUT to the unchanged module."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib.metadata import entry_points
from typing import Dict, List, Optional

from lm_resiliency.integrations.torchrun import TorchrunLaunchConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODULE = "examples.torchrun.resiliency_cycle.train"
ENTRY_POINT = "lm_resiliency.torchrun.plugin:get_rendezvous_handler_creator"
# Keep-alive expiry (3 s x 5) is how fast the agents notice a killed node. Shorter, an agent
# starved of CPU on a loaded host is dropped from a round it just completed, and the others then
# wait for its checkpoint step until join_timeout.
RDZV_CONF = {"keep_alive_interval": "3", "keep_alive_max_attempt": "5", "join_timeout": "600",
             "read_timeout": "120"}
MAX_RESTARTS = 64

POLICY = """schema_version = 1
interval = 2
enable_checkpoint = true
enable_detection = true

[checkpoint]
disk_folder = "{disk}"
disk_flush_interval = 2
verify_integrity = true
timeout_s = 20.0

[replay]
rotate_layers = false
"""


def write_plugin(base: str) -> str:
    """A directory holding a minimal distribution whose `torchrun.handlers` entry point is
    lm_resiliency (put it on the agents' PYTHONPATH)."""
    info = os.path.join(base, "plugin", "lm_resiliency_torchrun_plugin-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: lm-resiliency-torchrun-plugin\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[torchrun.handlers]\nlm_resiliency = {ENTRY_POINT}\n")
    return os.path.dirname(info)


def _plugin_path(work: str) -> Optional[str]:
    """torchrun finds rendezvous backends through the `torchrun.handlers` entry point; a checkout
    that is not pip-installed gets it from `write_plugin`."""
    if any(ep.name == "lm_resiliency" for ep in entry_points(group="torchrun.handlers")):
        return None
    return write_plugin(work)


class Cluster:
    """The agents of one run (`label`: "baseline" or "managed") under `root/work/<label>`."""

    def __init__(self, root: str, label: str, *, active: int, nodes: int, steps: int,
                 fault_campaign: Optional[str]) -> None:
        self.work = os.path.join(root, "work", label)
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(os.path.join(self.work, "logs"))
        self.label, self.active, self.nodes, self.steps = label, active, nodes, steps
        self.run_id = f"cycle-{label}-{os.getpid()}-{int(time.time())}"
        self.policy = os.path.join(self.work, "worker.toml")
        with open(self.policy, "w") as f:
            f.write(POLICY.format(disk=os.path.join(self.work, "gemini")))
        with open(os.path.join(self.work, "worker.json"), "w") as f:
            json.dump({"gemini_disk": os.path.join(self.work, "gemini"), "fault_campaign": fault_campaign}, f)
        self.plugin = _plugin_path(self.work)
        self.procs: Dict[int, subprocess.Popen] = {}
        self.killed: List[int] = []

    def context_path(self, node: int) -> str:
        return os.path.join(self.work, f"ctx-node{node}", "context.json")

    def log_path(self, node: int) -> str:
        return os.path.join(self.work, "logs", f"agent-node{node}.log")

    def start(self, node: int) -> None:
        config = TorchrunLaunchConfig(run_id=self.run_id, endpoint=os.path.join(self.work, "rdzv"),
                                      restart_context_path=self.context_path(node), min_nodes=self.active,
                                      max_nodes=self.nodes, nproc_per_node=1, max_restarts=MAX_RESTARTS,
                                      store_type="file", worker_config=self.policy, rdzv_conf=RDZV_CONF)
        command = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.5",
                   *config.arguments(["--module", MODULE, str(self.steps)])]
        machine_id = os.path.join(self.work, f"machine-id-node{node}")
        with open(machine_id, "w") as f:
            f.write(hashlib.md5(f"{self.run_id}-node{node}".encode()).hexdigest() + "\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LM_RESILIENCY", "TORCHELASTIC"))}
        env.update({"PYTHONPATH": os.pathsep.join(p for p in (self.plugin, ROOT) if p),
                    "LM_RESILIENCY_MACHINE_ID_PATH": machine_id, "LMR_CYCLE_DIR": self.work, "OMP_NUM_THREADS": "1"})
        with open(self.log_path(node), "w") as out:
            self.procs[node] = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def start_all(self, timeout: float) -> None:
        """The first `active` agents form generation 0; the rest then park as standbys."""
        for node in range(self.active):
            self.start(node)
        self.wait_for(lambda: all(os.path.exists(self.context_path(n)) for n in range(self.active)), timeout,
                      "the first generation to form")
        for node in range(self.active, self.nodes):
            self.start(node)

    def wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label}: waited {timeout:.0f}s for {what}; agent logs in "
                                   f"{os.path.join(self.work, 'logs')}")
            if all(proc.poll() is not None for proc in self.procs.values()):
                raise RuntimeError(f"{self.label}: every agent exited while waiting for {what}; agent logs in "
                                   f"{os.path.join(self.work, 'logs')}")
            time.sleep(0.25)

    def node_of_agent(self, pid: int) -> Optional[int]:
        """The node whose live agent has process id `pid` (a worker's parent)."""
        return next((node for node, proc in self.procs.items() if proc.pid == pid and proc.poll() is None), None)

    def kill(self, node: int) -> None:
        """The whole node: its agent and its worker (one process group)."""
        os.killpg(self.procs[node].pid, signal.SIGKILL)
        self.procs[node].wait(30)
        self.killed.append(node)

    def finish(self, timeout: float) -> Dict[int, int]:
        """Every agent's exit status (those still running after `timeout` are killed: -9)."""
        deadline = time.monotonic() + timeout
        codes = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes[node] = proc.wait(30)
        return codes

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)
