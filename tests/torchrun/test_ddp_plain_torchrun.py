"""A killed and relaunched DDP run under lm-resiliency is bitwise the same run without it, launched
the way users launch it: `examples/torchrun_ddp.py` (plain DDP, never imports lm_resiliency) on 3
workers under `--rdzv-backend=lm_resiliency`, GEMINI and SCOUT on, global rank 1 SIGKILLed after
step 7. The agent restarts its workers, the new generation resumes at step 6 from memory, and the
run ends bitwise equal to the same module under torchrun's own c10d rendezvous. On 3 ranks a sum
depends on its order: this holds because DDP keeps the bucket layout it chose and SCOUT's gradient
trace averages as DDP's reducer does (docs/frameworks.md, "DDP and bitwise resume")."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

from tests.torchrun import launcher as L

MODULE = "examples.torchrun_ddp"


@pytest.mark.slow  # two 3-worker torchrun launches and a restart: a few minutes on 2 loaded cores
@pytest.mark.timeout(900)
def test_worker_sigkill_with_scout_on_ends_bitwise_equal_to_plain_torchrun(tmp_path):
    base = str(tmp_path)
    killed_out, plain_out = os.path.join(base, "killed"), os.path.join(base, "plain")
    os.makedirs(killed_out)
    os.makedirs(plain_out)
    policy = L.write_policy(base, L.POLICY.format(disk=os.path.join(base, "disk")).replace(
        "enable_detection = false", "enable_detection = true"), "scout.toml")
    run_id = f"plain-eq-{uuid.uuid4().hex[:8]}"
    command = L.agent_command(run_id=run_id, endpoint=os.path.join(base, f"rdzv-{run_id}"),
                              context=os.path.join(base, "ctx", "context.json"), policy=policy, nnodes="1:1",
                              nproc=3, max_restarts=2, module=MODULE, args=[killed_out, "12", "1", "7"])
    env = L.agent_env(base, L.machine_id_file(base, "a"))
    killed = L.run_agent(command, env, 400, os.path.join(base, "agent-killed.log"))
    assert killed.returncode == 0, killed.stdout[-8000:]
    assert "at step 6 from memory (pytorch/ddp)" in killed.stdout, killed.stdout[-8000:]
    assert os.listdir(killed_out) == ["final-1.json"]  # generation 0 never finished

    plain_env = {k: v for k, v in env.items() if k != "LM_RESILIENCY_MACHINE_ID_PATH"}
    plain = L.run_agent([sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.5", "--nnodes=1",
                         "--nproc-per-node=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{L.free_port()}",
                         f"--rdzv-id=plain-{uuid.uuid4().hex[:8]}", "--module", MODULE, plain_out, "12"],
                        plain_env, 300, os.path.join(base, "agent-plain.log"))
    assert plain.returncode == 0, plain.stdout[-8000:]

    resumed, baseline = L.final_state(killed_out, 1), L.final_state(plain_out, 0)
    assert (resumed["start"], baseline["start"]) == (6, 0)
    assert resumed["tensors"].keys() == baseline["tensors"].keys() and len(baseline["tensors"]) == 16
    different = [name for name in baseline["tensors"] if resumed["tensors"][name] != baseline["tensors"][name]]
    assert not different, f"not bitwise equal to plain torchrun: {different}"
