"""Start real `python -m torch.distributed.run` agents with `--rdzv-backend=lm_resiliency`.

The backend is found the way torchrun finds any plugin: the `torchrun.handlers` entry point. A
test writes a minimal distribution's metadata (`entry_points.txt`) into a temporary directory on
the agents' PYTHONPATH, so the checkout under test provides it without reinstalling the package.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from typing import Dict, List, Optional

from examples.torchrun.resiliency_cycle.agents import write_plugin as plugin_path  # noqa: F401 - re-exported
from lm_resiliency.integrations.torchrun import TorchrunLaunchConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def machine_id_file(base: str, name: str) -> str:
    path = os.path.join(base, f"machine-id-{name}")
    with open(path, "w") as f:
        f.write(hashlib.md5(name.encode()).hexdigest() + "\n")
    return path


def read_log(path: str) -> str:
    return _tail(path, 400000)


def write_policy(base: str, text: str = "", name: str = "worker.toml") -> str:
    path = os.path.join(base, name)
    with open(path, "w") as f:
        f.write(text or POLICY.format(disk=os.path.join(base, "gemini-disk")))
    return path


POLICY = """schema_version = 1
interval = 2
enable_checkpoint = true
enable_detection = false

[checkpoint]
disk_folder = "{disk}"
disk_flush_interval = 0
verify_integrity = true
timeout_s = 20.0
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(*, run_id: str, endpoint: str, context: str, policy: Optional[str], nnodes: str,
                  nproc: int, max_restarts: int, module: str, args: List[str], store_type: str = "file",
                  rdzv_conf: Optional[Dict[str, str]] = None) -> List[str]:
    low, high = (int(n) for n in nnodes.split(":"))
    config = TorchrunLaunchConfig(run_id=run_id, endpoint=endpoint, restart_context_path=context, min_nodes=low,
                                  max_nodes=high, nproc_per_node=nproc, max_restarts=max_restarts,
                                  store_type=store_type, worker_config=policy, rdzv_conf=rdzv_conf or {})
    return [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.5",
            *config.arguments(["--module", module, *args])]


def agent_env(base: str, machine_id: str, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LM_RESILIENCY", "TORCHELASTIC"))}
    env.update({"PYTHONPATH": os.pathsep.join([plugin_path(base), ROOT]), "LM_RESILIENCY_MACHINE_ID_PATH": machine_id,
                "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


def start_agent(command: List[str], env: Dict[str, str], log: str, cwd: str = ROOT) -> subprocess.Popen:
    """An agent in its own session (so `stop` ends it with its workers), output to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    proc.wait()


def finish(proc: subprocess.Popen, timeout: float, log: str) -> subprocess.CompletedProcess:
    """Wait for an agent (killed, with its workers, after `timeout`); its exit code and log."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError(f"torchrun agent did not finish within {timeout}s; log:\n{_tail(log)}") from None
    return subprocess.CompletedProcess(proc.args, code, _tail(log, 400000), "")


def run_agent(command: List[str], env: Dict[str, str], timeout: float, log: str,
              cwd: str = ROOT) -> subprocess.CompletedProcess:
    """One agent to completion (killed, with its workers, after `timeout`)."""
    return finish(start_agent(command, env, log, cwd), timeout, log)


def final_state(out_dir: str, restart_count: int) -> dict:
    """What examples/torchrun_ddp.py's rank 0 wrote at the end of the generation `restart_count`."""
    with open(os.path.join(out_dir, f"final-{restart_count}.json")) as f:
        return json.load(f)


def _tail(path: str, size: int = 6000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-size:]
