"""The README's production command on CPU: `examples/production_loops/pytorch.py` (a DDP loop that
never imports lm_resiliency) under `--rdzv-backend=lm_resiliency` with the shipped worker policy
(GEMINI and SCOUT on), launched as the README writes it, ends bitwise equal to the same loop under
torchrun's own c10d rendezvous without lm-resiliency. 3 workers, where a sum depends on its order:
lm-resiliency leaves DDP's bucket layout and gradient arithmetic as they are (docs/frameworks.md,
"DDP and bitwise resume")."""

from __future__ import annotations

import json
import os
import sys

from tests.torchrun.launcher import ROOT, agent_env, free_port, machine_id_file, run_agent, write_policy

POLICY = os.path.join(ROOT, "examples", "production_loops", "policies", "resiliency.toml")
SHIPPED_FOLDER = '"/tmp/lm-resiliency-checkpoints"'


def _shipped_policy(base: str) -> str:
    """The shipped policy, byte for byte, except its (absolute) disk_folder, which points into this
    test's scratch directory so runs never share checkpoints."""
    with open(POLICY) as f:
        text = f.read()
    assert text.count(SHIPPED_FOLDER) == 1
    return write_policy(base, text.replace(SHIPPED_FOLDER, json.dumps(os.path.join(base, "checkpoints"))))
MODULE = "examples.production_loops.pytorch"
STEPS = 24
WORKERS = 3


def _torchrun(rdzv: list, out: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.5", "--nnodes=1:2",
            f"--nproc-per-node={WORKERS}", "--max-restarts=4", *rdzv, "--module", MODULE,
            "--validation-output-dir", out, "--steps", str(STEPS)]


def _final(out: str) -> dict:
    with open(os.path.join(out, "final-0.json")) as f:
        return json.load(f)


def test_readme_production_command_runs_the_unchanged_loop_bitwise_equal_to_plain_torchrun(tmp_path):
    base = str(tmp_path)
    context = os.path.join(base, "context", "context.json")
    managed, plain = os.path.join(base, "managed"), os.path.join(base, "plain")
    env = agent_env(base, machine_id_file(base, "node-a"))
    command = _torchrun(["--rdzv-backend=lm_resiliency", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                         "--rdzv-id=pytorch-example",
                         f"--rdzv-conf=store_type=tcp,read_timeout=120,lm_resiliency_restart_context_path={context},"
                         f"lm_resiliency_worker_config={_shipped_policy(base)}"], managed)
    result = run_agent(command, env, 240, os.path.join(base, "managed.log"), cwd=base)
    assert result.returncode == 0, result.stdout
    with open(context) as f:
        selected = json.load(f)
    assert (selected["generation"], selected["checkpoint_step"], selected["decision"]) == (0, 0, "fresh")
    records = sorted(name for name in os.listdir(os.path.dirname(context)) if name.startswith("worker-"))
    assert records == [f"worker-{rank}.json" for rank in range(WORKERS)]
    for name in records:
        with open(os.path.join(os.path.dirname(context), name)) as f:
            assert json.load(f)["step"] == 20  # the zero-import attach captured every 10 steps

    plain_env = {k: v for k, v in env.items() if k != "LM_RESILIENCY_MACHINE_ID_PATH"}
    baseline = _torchrun(["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=plain"],
                         plain)
    result = run_agent(baseline, plain_env, 240, os.path.join(base, "plain.log"), cwd=base)
    assert result.returncode == 0, result.stdout
    assert _final(managed) == _final(plain)
    assert _final(managed)["start"] == 0 and len(_final(managed)["tensors"]) == 20  # 5 parameters, AdamW step and moments
