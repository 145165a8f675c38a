"""SCOUT-named node retirement under the built-in policy: real `python -m torch.distributed.run`
agents, a DDP module that never imports lm_resiliency (tests/torchrun/sdc_ddp.py), gloo, one
machine-id file per agent."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from tests.torchrun import launcher as L
from tests.torchrun.test_torchrun_recovery import _agent, _final

MODULE = "tests.torchrun.sdc_ddp"
CONF = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "join_timeout": "300"}
# A hang is an idle spell this long; a healthy step of this workload takes well under a second.
_HANG_REPLAY = "\n[replay]\nhang_stall_threshold_s = 10.0\nmonitor_poll_interval_s = 0.5\n"


def _policy(base: str, extra: str = "") -> str:
    text = L.POLICY.format(disk=os.path.join(base, "disk")).replace("enable_detection = false",
                                                                    "enable_detection = true")
    return L.write_policy(base, text.replace("[checkpoint]", "[checkpoint]\nreplication_jump = 2") + extra,
                          "scout.toml")


def _context(base: str, name: str) -> dict:
    with open(os.path.join(base, f"ctx-{name}", "context.json")) as f:
        return json.load(f)


def _starts(out_dir: str) -> list:
    starts = []
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("start-"):
            with open(os.path.join(out_dir, name)) as f:
                starts.append(json.load(f))
    return starts


def _run_agents(base: str, run_id: str, names: str, nnodes: str, policy: str, args: list, timeout: float,
                stagger: bool, module: str = MODULE, conf=None, while_running=None) -> dict:
    """Start the agents (with `stagger`, the third only after the first two formed generation 0),
    call `while_running()` if given, and wait for every agent's exit code."""
    agents = {}
    try:
        for name in names:
            command, env = _agent(base, run_id, name=name, nnodes=nnodes, nproc=2, max_restarts=2, policy=policy,
                                  module=module, args=args, rdzv_conf=dict(CONF, **(conf or {})))
            agents[name] = L.start_agent(command, env, os.path.join(base, f"agent-{name}.log"))
            if stagger and name == names[1]:  # the first min_nodes registrations; the next one parks
                deadline = time.monotonic() + 240
                while not all(os.path.exists(os.path.join(base, f"ctx-{n}", "context.json")) for n in names[:2]):
                    assert time.monotonic() < deadline, "the first two agents did not form generation 0"
                    time.sleep(0.5)
        if while_running is not None:
            while_running()
        return {name: proc.wait(timeout) for name, proc in agents.items()}
    finally:
        for proc in agents.values():
            L.stop(proc)


def _retire_and_resume(tmp_path, fault_args: list, found: str, policy_extra: str = "") -> tuple:
    """3 agents, --nnodes=2:3, 2 workers each, SCOUT checks and captures every 2 steps, a fault on
    node slot 1 (`fault_args`). Slot 1's agent retires with `found` (exit 0, never rejoins), the
    parked standby takes slot 1, every worker of the next generation loads step 6, the newest
    RECOVERY_VERIFIED step, and the run ends bitwise equal to an uninterrupted one. Returns the
    agents' logs, the retired agent and the surviving one."""
    base = str(tmp_path)
    policy = _policy(base, policy_extra)
    faulty_out, clean_out = os.path.join(base, "faulty"), os.path.join(base, "clean")
    os.makedirs(faulty_out)
    os.makedirs(clean_out)
    run_id = f"retire-{uuid.uuid4().hex[:8]}"
    codes = _run_agents(base, run_id, "abc", "2:3", policy, [faulty_out, "12", *fault_args], 600, stagger=True)
    logs = {name: L.read_log(os.path.join(base, f"agent-{name}.log")) for name in "abc"}
    assert codes == {"a": 0, "b": 0, "c": 0}, (codes, {n: log[-5000:] for n, log in logs.items()})
    retired = [name for name in "ab" if "RETIRED from run" in logs[name]]
    assert len(retired) == 1, logs
    survivor = "b" if retired == ["a"] else "a"
    assert found in logs[retired[0]]
    assert _context(base, retired[0])["slot"] == 1 and _context(base, retired[0])["generation"] == 0
    standby, kept = _context(base, "c"), _context(base, survivor)
    assert (standby["slot"], standby["decision"], kept["slot"], kept["decision"]) == (
        1, "replacement", 0, "same-node restart")
    for context in (standby, kept):
        assert (context["checkpoint_step"], context["checkpoint_source"], context["trust"]) == (
            6, "gemini", "recovery_verified")
        assert f"{found}, node slots [1] retired: step 6, the newest RECOVERY_VERIFIED step every node holds" in \
            context["reason"]
    assert "resumed run" in logs["c"] + logs[survivor] and "at step 6" in logs["c"] + logs[survivor]
    resumed_starts = [s for s in _starts(faulty_out) if s["start"] != 0]
    assert sorted((s["group_rank"], s["start"]) for s in resumed_starts) == [(0, 6), (0, 6), (1, 6), (1, 6)]
    clean_codes = _run_agents(base, f"clean-{uuid.uuid4().hex[:8]}", "xy", "2:2", policy, [clean_out, "12"], 400,
                              stagger=False)
    assert clean_codes == {"x": 0, "y": 0}
    resumed, baseline = _final(faulty_out), _final(clean_out)
    assert (resumed["start"], baseline["start"]) == (6, 0)
    different = [name for name in baseline["tensors"] if resumed["tensors"][name] != baseline["tensors"][name]]
    assert not different, f"not bitwise equal after the retirement: {different}"
    return logs, retired[0], survivor


@pytest.mark.slow
def test_a_node_scout_names_for_sdc_is_retired_and_the_standby_resumes_from_recovery_verified(tmp_path):
    """Global rank 3 (node slot 1) silently corrupts a weight after step 7; SCOUT's check at step
    8 names it, the capture of step 8 is vetoed, every worker ends the generation."""
    _retire_and_resume(tmp_path, ["3", "7"], "SCOUT found sdc at step 8 on global ranks [3] in generation 0")


@pytest.mark.slow
def test_a_node_scout_names_for_a_hang_is_retired_and_the_standby_resumes_from_recovery_verified(tmp_path):
    """Global rank 2 (node slot 1) blocks forever after step 7; its peers wait in the next
    all-reduce. SCOUT's out-of-band monitor (a 10 s hang threshold) localizes rank 2 on rank 0,
    whose node alone records the hang: rank 0's agent publishes slot 1 in the store, rank 0 ends
    its process, every worker group ends, and slot 1's agent, which holds no fault record, finds
    the store key and retires."""
    found = "SCOUT found hang at step 7 on global ranks [2] in generation 0"
    logs, retired, survivor = _retire_and_resume(tmp_path, ["2", "7", "hang"], found, _HANG_REPLAY)
    assert not [n for n in os.listdir(tmp_path / f"ctx-{retired}") if n.startswith("fault-")], \
        "the hung node recorded the fault itself: the store path was not exercised"
    assert "published SCOUT's hang verdict of generation 0: node slots [1] retire" in logs[survivor]
    assert "SCOUT localized a hang at step 7 on global ranks [2] (node slots [1]); the agent published it" in \
        logs[survivor]
