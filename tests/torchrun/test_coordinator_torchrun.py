"""A recovery manager drives a real `python -m torch.distributed.run` agent through
TorchrunRecoveryCoordinator: the workers (examples/torchrun_ddp.py, which never imports
lm_resiliency) load exactly the step the manager selected, not the agents' own choice."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from lm_resiliency.integrations.torchrun import TorchrunRecoveryCoordinator, TorchrunRecoveryRequest
from tests.torchrun import launcher as L
from tests.torchrun.test_torchrun_recovery import MODULE, _agent, _final, _run


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


@pytest.mark.slow
def test_a_manager_retires_a_slot_and_the_standby_loads_the_published_step(tmp_path):
    """3 managed agents, --nnodes=2:3, 2 workers each; global rank 3 (slot 1) SIGKILLs itself
    after step 7. The manager's successor retires slot 1 at step 6: that agent leaves (exit 0),
    the parked standby is admitted with the manager's step, and the run ends bitwise equal."""
    from tests.torchrun.test_retirement import _context, _run_agents

    base = str(tmp_path)
    policy = L.write_policy(base, L.POLICY.format(disk=os.path.join(base, "disk")).replace(
        "[checkpoint]", "[checkpoint]\nreplication_jump = 2"), "jump.toml")
    managed_out, clean_out = os.path.join(base, "managed"), os.path.join(base, "clean")
    os.makedirs(managed_out)
    os.makedirs(clean_out)
    run_id = f"managed-{uuid.uuid4().hex[:8]}"
    endpoint = os.path.join(base, f"rdzv-{run_id}")

    def manage() -> None:
        with TorchrunRecoveryCoordinator.from_endpoint(endpoint, run_id) as manager:
            assert manager.initial_placement(timeout_s=60).nodes == 2
            manager.publish_successor(TorchrunRecoveryRequest(generation=1, checkpoint_step=6, trust="latest",
                                                              retire_slots=(1,), deadline_s=400,
                                                              reason="slot 1 lost a worker"))
            deadline = time.monotonic() + 500
            while not any(name.startswith("final-") for name in os.listdir(managed_out)):
                assert time.monotonic() < deadline, "the managed successor did not finish"
                manager.check_health()
                time.sleep(1)

    codes = _run_agents(base, run_id, "abc", "2:3", policy, [managed_out, "12", "3", "7"], 600, stagger=True,
                        module=MODULE, conf={"lm_resiliency_manager": "1"}, while_running=manage)
    logs = {name: L.read_log(os.path.join(base, f"agent-{name}.log")) for name in "abc"}
    assert codes == {"a": 0, "b": 0, "c": 0}, (codes, {n: log[-5000:] for n, log in logs.items()})
    retired = [name for name in "ab" if "RETIRED from run" in logs[name]]
    assert len(retired) == 1 and "the recovery manager retired slot 1 in successor generation 1" in \
        logs[retired[0]], logs
    standby = _context(base, "c")
    assert (standby["generation"], standby["slot"], standby["decision"], standby["checkpoint_step"]) == (
        1, 1, "replacement", 6)
    assert standby["reason"] == "selected by the recovery manager: slot 1 lost a worker"
    clean = _run_agents(base, f"clean-{run_id}", "xy", "2:2", policy, [clean_out, "12"], 400, stagger=False,
                        module=MODULE)
    assert clean == {"x": 0, "y": 0}
    resumed, baseline = _final(managed_out), _final(clean_out)
    assert (resumed["start"], baseline["start"]) == (6, 0)
    different = [name for name in baseline["tensors"] if resumed["tensors"][name] != baseline["tensors"][name]]
    assert not different, f"not bitwise equal after the managed replacement: {different}"
