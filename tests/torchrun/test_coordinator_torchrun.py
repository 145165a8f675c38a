"""A recovery manager drives a real `python -m torch.distributed.run` agent through
TorchrunRecoveryCoordinator: the workers (examples/torchrun_ddp.py, which never imports
lm_resiliency) load exactly the step the manager selected, not the agents' own choice."""

from __future__ import annotations

import os
import uuid

import pytest

from lm_resiliency.integrations.torchrun import TorchrunRecoveryCoordinator, TorchrunRecoveryRequest
from tests.torchrun import launcher as L
from tests.torchrun.test_torchrun_recovery import _agent, _run


@pytest.mark.slow
def test_the_workers_load_the_older_step_a_manager_published(tmp_path):
    """One managed agent, 3 workers, captures every 2 steps, rank 1 SIGKILLed after step 7. The
    built-in policy would resume at 6; the manager publishes generation 1 at step 4 (GEMINI keeps
    the previous capture too), and the run still ends bitwise equal to an uninterrupted one."""
    base = str(tmp_path)
    managed_out, clean_out = os.path.join(base, "managed"), os.path.join(base, "clean")
    os.makedirs(managed_out)
    os.makedirs(clean_out)
    run_id = f"managed-{uuid.uuid4().hex[:8]}"
    command, env = _agent(base, run_id, name="m", max_restarts=2, args=[managed_out, "12", "1", "7"],
                          rdzv_conf={"lm_resiliency_manager": "1", "join_timeout": "300"})
    log = os.path.join(base, "agent-m.log")
    agent = L.start_agent(command, env, log)
    try:
        with TorchrunRecoveryCoordinator.from_endpoint(os.path.join(base, f"rdzv-{run_id}"), run_id) as manager:
            initial = manager.initial_placement(timeout_s=240)
            assert (initial.generation, initial.nodes, len(initial.node_ids)) == (0, 1, 1)
            manager.publish_successor(TorchrunRecoveryRequest(generation=1, checkpoint_step=4, trust="latest",
                                                              deadline_s=300, reason="manager test: step 4"))
            result = L.finish(agent, 400, log)
            manager.check_health()
    finally:
        L.stop(agent)
    assert result.returncode == 0, result.stdout[-8000:]
    assert ("generation 1, node slot 0 of 1: same-node restart, checkpoint step 4 (selected by the recovery "
            "manager: manager test: step 4)") in result.stdout
    assert "at step 4 from memory (pytorch/ddp)" in result.stdout
    clean = _run(base, "clean", 300, run_id=f"clean-{uuid.uuid4().hex[:8]}", args=[clean_out, "12"])
    assert clean.returncode == 0, clean.stdout[-8000:]
    resumed, baseline = L.final_state(managed_out, 1), L.final_state(clean_out, 0)
    assert (resumed["start"], baseline["start"]) == (4, 0)
    different = [name for name in baseline["tensors"] if resumed["tensors"][name] != baseline["tensors"][name]]
    assert not different, f"not bitwise equal after the manager's restart: {different}"
