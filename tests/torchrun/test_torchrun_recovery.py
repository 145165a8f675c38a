"""Real `python -m torch.distributed.run` agents under `--rdzv-backend=lm_resiliency`, with a DDP
module that never imports lm_resiliency (examples/torchrun_ddp.py), gloo, one machine-id
file per agent."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from tests.torchrun import launcher as L

MODULE = "examples.torchrun_ddp"


def _agent(base: str, run_id: str, *, name: str = "a", nnodes: str = "1:1", nproc: int = 3, max_restarts: int = 0,
           module: str = MODULE, args=(), policy: str = "", machine: str = "", context: str = "",
           extra_env=None, rdzv_conf=None):
    command = L.agent_command(run_id=run_id, endpoint=os.path.join(base, f"rdzv-{run_id}"),
                              context=context or os.path.join(base, f"ctx-{name}", "context.json"),
                              policy=policy or L.write_policy(base), nnodes=nnodes, nproc=nproc,
                              max_restarts=max_restarts, module=module, args=list(args), rdzv_conf=rdzv_conf)
    env = L.agent_env(base, L.machine_id_file(base, machine or name), extra_env)
    return command, env


def _run(base: str, name: str, timeout: float, **kwargs):
    command, env = _agent(base, kwargs.pop("run_id"), name=name, **kwargs)
    return L.run_agent(command, env, timeout, os.path.join(base, f"agent-{name}.log"))


@pytest.mark.slow
def test_worker_sigkill_restarts_the_node_on_the_last_capture_and_ends_bitwise_equal(tmp_path):
    """One agent, 3 DDP workers, rank 1 SIGKILLed after step 7 (captures every 2 steps): the
    next generation starts at step 6 from memory and ends bitwise equal to an uninterrupted run."""
    base = str(tmp_path)
    killed_out, clean_out = os.path.join(base, "killed"), os.path.join(base, "clean")
    os.makedirs(killed_out)
    os.makedirs(clean_out)
    killed = _run(base, "killed", 400, run_id=f"kill-{uuid.uuid4().hex[:8]}", max_restarts=2,
                  args=[killed_out, "12", "1", "7"])
    assert killed.returncode == 0, killed.stdout[-8000:]
    assert "generation 1, node slot 0 of 1: same-node restart, checkpoint step 6" in killed.stdout
    assert "resumed run" in killed.stdout and "at step 6 from memory (pytorch/ddp)" in killed.stdout
    assert os.listdir(killed_out) == ["final-1.json"]  # generation 0 never finished
    clean = _run(base, "clean", 300, run_id=f"clean-{uuid.uuid4().hex[:8]}", args=[clean_out, "12"])
    assert clean.returncode == 0, clean.stdout[-8000:]
    resumed, baseline = L.final_state(killed_out, 1), L.final_state(clean_out, 0)
    assert (resumed["start"], baseline["start"]) == (6, 0)
    assert resumed["tensors"].keys() == baseline["tensors"].keys() and len(baseline["tensors"]) == 16
    different = [name for name in baseline["tensors"] if resumed["tensors"][name] != baseline["tensors"][name]]
    assert not different, f"not bitwise equal after the restart: {different}"


def _final(out_dir: str) -> dict:
    names = [name for name in os.listdir(out_dir) if name.startswith("final-")]
    assert len(names) == 1, names
    return L.final_state(out_dir, int(names[0][len("final-"):-len(".json")]))


@pytest.mark.slow
def test_a_killed_active_node_is_replaced_by_the_parked_standby_bitwise(tmp_path):
    """3 agents, --nnodes=2:3, 2 workers each: the third parks. Global rank 3 SIGKILLs its agent
    and itself after step 7 (the whole node is gone); the standby takes the free slot, the
    generation resumes at capture 6, and the run ends bitwise equal to an uninterrupted one."""
    base = str(tmp_path)
    policy = L.write_policy(base, L.POLICY.format(disk=os.path.join(base, "disk")).replace(
        "[checkpoint]", "[checkpoint]\nreplication_jump = 2"), "jump.toml")
    conf = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "join_timeout": "300"}
    killed_out, clean_out = os.path.join(base, "killed"), os.path.join(base, "clean")
    os.makedirs(killed_out)
    os.makedirs(clean_out)
    run_id = f"standby-{uuid.uuid4().hex[:8]}"
    agents = {}
    try:
        for name in ("a", "b", "c"):
            command, env = _agent(base, run_id, name=name, nnodes="2:3", nproc=2, max_restarts=2, policy=policy,
                                  args=[killed_out, "12", "3", "7", "agent"], rdzv_conf=conf)
            agents[name] = L.start_agent(command, env, os.path.join(base, f"agent-{name}.log"))
            if name == "b":  # a and b are the first min_nodes registrations; c arrives later
                deadline = time.monotonic() + 240
                while not all(os.path.exists(os.path.join(base, f"ctx-{n}", "context.json")) for n in "ab"):
                    assert time.monotonic() < deadline, "a and b did not form the first generation"
                    time.sleep(0.5)
        codes = {name: proc.wait(500) for name, proc in agents.items()}
    finally:
        for proc in agents.values():
            L.stop(proc)
    logs = {name: L.read_log(os.path.join(base, f"agent-{name}.log")) for name in agents}
    killed_agents = [name for name, code in codes.items() if code == -9]
    assert len(killed_agents) == 1 and killed_agents[0] in "ab", (codes, logs)
    assert all(code == 0 for name, code in codes.items() if name not in killed_agents), (codes, logs["c"][-6000:])
    assert "replacement, checkpoint step 6" in logs["c"]
    clean_run = f"clean-{uuid.uuid4().hex[:8]}"
    clean = {}
    try:
        for name in ("x", "y"):
            command, env = _agent(base, clean_run, name=name, nnodes="2:2", nproc=2, policy=policy,
                                  args=[clean_out, "12"], rdzv_conf=conf)
            clean[name] = L.start_agent(command, env, os.path.join(base, f"agent-{name}.log"))
        assert [proc.wait(400) for proc in clean.values()] == [0, 0]
    finally:
        for proc in clean.values():
            L.stop(proc)
    resumed, baseline = _final(killed_out), _final(clean_out)
    assert (resumed["start"], baseline["start"]) == (6, 0)
    different = [name for name in baseline["tensors"] if resumed["tensors"][name] != baseline["tensors"][name]]
    assert not different, f"not bitwise equal after the replacement: {different}"


def _refused_agent(base: str, run_id: str, policies, machines, timeout: float = 150):
    """Start two agents of a 2-node run; whichever registers second must stop on its own. Returns
    its log (the other one, left waiting for a second node, is stopped)."""
    procs = {}
    try:
        for name, policy, machine in zip(("first", "second"), policies, machines):
            command, env = _agent(base, run_id, name=name, nnodes="2:2", nproc=1, policy=policy, machine=machine)
            procs[name] = L.start_agent(command, env, os.path.join(base, f"{name}.log"))
        deadline = time.monotonic() + timeout
        while all(proc.poll() is None for proc in procs.values()):
            assert time.monotonic() < deadline, "neither agent stopped"
            time.sleep(0.5)
    finally:
        for proc in procs.values():
            L.stop(proc)
    exited = [name for name, proc in procs.items() if proc.returncode not in (None, -9)]
    assert len(exited) == 1 and procs[exited[0]].returncode != 0, {n: p.returncode for n, p in procs.items()}
    return L.read_log(os.path.join(base, f"{exited[0]}.log"))


def test_two_agents_with_one_machine_id_fail_closed(tmp_path):
    base = str(tmp_path)
    log = _refused_agent(base, f"dup-{uuid.uuid4().hex[:8]}", ("", ""), ("same", "same"))
    assert "is already registered in run" in log and "two agents share one machine id" in log


def test_policy_digest_mismatch_between_nodes_fails_closed(tmp_path):
    base = str(tmp_path)
    other = L.write_policy(base, L.POLICY.format(disk=os.path.join(base, "disk")).replace("interval = 2",
                                                                                          "interval = 3"), "other.toml")
    log = _refused_agent(base, f"pol-{uuid.uuid4().hex[:8]}", ("", other), ("first", "second"))
    assert "worker policy digest" in log and "differs from the one run" in log


def test_group_readable_restart_context_dir_fails_closed_before_any_worker(tmp_path):
    base = str(tmp_path)
    shared = os.path.join(base, "shared-ctx")
    os.makedirs(shared)
    os.chmod(shared, 0o755)
    out = os.path.join(base, "out")
    os.makedirs(out)
    result = _run(base, "a", 120, run_id=f"perm-{uuid.uuid4().hex[:8]}", nproc=1,
                  context=os.path.join(shared, "context.json"), args=[out, "2"])
    assert result.returncode != 0
    assert "has mode 0755: group/other access is not allowed" in result.stdout
    assert os.listdir(out) == [] and os.stat(shared).st_mode & 0o777 == 0o755


def test_two_higher_level_frameworks_imported_fail_closed_in_the_worker(tmp_path):
    base = str(tmp_path)
    policy = L.write_policy(base, 'schema_version = 1\nadapter = "tests.torchrun.custom_adapter:factory"\n',
                            "custom.toml")
    result = _run(base, "a", 180, run_id=f"fw-{uuid.uuid4().hex[:8]}", nproc=1, policy=policy,
                  module="tests.torchrun.two_frameworks", extra_env={"TEST_ADAPTER_OUT": base})
    assert result.returncode != 0
    assert "TorchTitan and DeepSpeed are both imported" in result.stdout
    # The custom adapter was installed before the user module ran, with this generation's context.
    with open(os.path.join(base, "installed-0.json")) as f:
        assert f.read() == '{"generation": 0, "slot": 0, "step": 0, "same": true}'
