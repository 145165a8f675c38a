"""Issue 22 end to end: the torchrun loop's records are bound to their launch. Real
`python -m torch.distributed.run` agents over one `store_type=file` endpoint that survives every
launch, a DDP module that never imports lm_resiliency (examples/torchrun_ddp.py), gloo, 3 ranks
where the final state is compared bitwise."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import threading
import time
import uuid

import pytest

from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.binding import RoundBinding
from lm_resiliency.torchrun.retirement import fault_for, write_fault
from tests.torchrun import launcher as L

MODULE = "examples.torchrun_ddp"
pytestmark = pytest.mark.slow


def _policy(base: str) -> str:
    """The documented policy (disk_flush_interval = 0: memory only), shared memory in the test's own folder."""
    text = L.POLICY.format(disk=os.path.join(base, "disk")).replace(
        "[checkpoint]", f"[checkpoint]\nshared_memory_dir = \"{os.path.join(base, 'shm')}\"")
    return L.write_policy(base, text, "memory-only.toml")


def _launch(base: str, run_id: str, name: str, *, nproc: int, args, max_restarts: int = 1, machine: str = "node",
            context: str = "ctx", nnodes: str = "1:1", timeout: float = 400, start_only: bool = False):
    command = L.agent_command(run_id=run_id, endpoint=os.path.join(base, "rdzv"),
                              context=os.path.join(base, context, "context.json"), policy=_policy(base),
                              nnodes=nnodes, nproc=nproc, max_restarts=max_restarts, module=MODULE, args=list(args),
                              rdzv_conf={"keep_alive_interval": "1", "keep_alive_max_attempt": "3"})
    env = L.agent_env(base, L.machine_id_file(base, machine))
    log = os.path.join(base, f"agent-{name}.log")
    if start_only:
        return L.start_agent(command, env, log), log
    return L.run_agent(command, env, timeout, log)


def _out(base: str, name: str) -> str:
    path = os.path.join(base, name)
    os.makedirs(path)
    return path


def _final(out_dir: str) -> dict:
    names = [name for name in os.listdir(out_dir) if name.startswith("final-")]
    assert len(names) == 1, names
    return L.final_state(out_dir, int(names[0][len("final-"):-len(".json")]))


def _differ(resumed: dict, baseline: dict) -> list:
    assert resumed["tensors"].keys() == baseline["tensors"].keys() and len(baseline["tensors"]) == 16
    return [name for name in baseline["tensors"] if resumed["tensors"][name] != baseline["tensors"][name]]


def _context(base: str, name: str = "ctx") -> ctx.RestartContext:
    return ctx.read_context(os.path.join(base, name, "context.json"))[0]


def test_relaunches_of_one_run_id_over_a_surviving_file_store_never_wedge(tmp_path):
    """One run id, one endpoint file, one restart-context directory, one machine, three launches
    (about 6 minutes on the loaded 2-core machine, with two baselines):

    1. 3 workers; once every worker recorded a capture of step 6 or later, the whole node dies
       (SIGKILL to the agent and its workers: nothing is flushed). Then /dev/shm is emptied
       (reboot, cleanup): the documented policy has disk_flush_interval = 0, so the recorded step
       exists nowhere, while the restart-context directory survives.
    2. The relaunch (a requeued job: same command) resumes from the records launch 1 left,
       cannot load step 6, records that nothing is loadable, and its next generation starts fresh
       and finishes (bitwise equal to an uninterrupted 3-worker run) instead of failing forever.
    3. A launch with --nproc-per-node 2, whose directory also holds a fault record launch 2 left for
       generation 0 (what an earlier launch's SCOUT verdict leaves): the 3-worker records are
       ignored with a line naming them, the run starts fresh; rank 1 dies after step 7 (an
       ordinary crash in generation 0), the stale fault record is ignored instead of retiring this
       node, and generation 1 resumes at step 6 and finishes bitwise equal to an uninterrupted
       2-worker run."""
    base = str(tmp_path)
    run_id = f"requeue-{uuid.uuid4().hex[:8]}"
    proc, log = _launch(base, run_id, "1", nproc=3, max_restarts=0, args=[_out(base, "out-1"), "1000000"],
                        start_only=True)
    try:
        _wait_for_records(os.path.join(base, "ctx"), 3, 6, proc, log)
    finally:
        _crash(proc)  # the node is gone: agent and workers SIGKILLed together
    recorded = _wait_for_records(os.path.join(base, "ctx"), 3, 6, proc, log)
    launch_1 = _context(base)
    assert (launch_1.generation, launch_1.nproc_per_node) == (0, 3)
    assert os.listdir(os.path.join(base, "shm")), "GEMINI kept no shared memory"
    assert not glob.glob(os.path.join(base, "disk", "*", "*", "*.gemini")), "something was flushed to disk"
    shutil.rmtree(os.path.join(base, "shm"))

    out_2 = _out(base, "out-2")
    second = _launch(base, run_id, "2", nproc=3, args=[out_2, "12"])
    assert second.returncode == 0, second.stdout[-8000:]
    launch_2 = _context(base)
    assert launch_2.launch_id != launch_1.launch_id
    assert f"generation 0, node slot 0 of 1: same-node restart, checkpoint step {recorded}" in second.stdout
    assert f"resumes from the worker records launch {launch_1.launch_id[:12]}" in second.stdout
    assert f"generation 0 could not start from step {recorded}; recorded for the agents: GEMINI can load nothing" \
        in second.stdout
    assert "generation 1, node slot 0 of 1: fresh, checkpoint step 0 (no node recorded a capture it can load " \
           f"(steps [{recorded}] could not be loaded): fresh start)" in second.stdout
    assert _final(out_2)["start"] == 0

    binding = RoundBinding(run_id=run_id, launch_id=launch_2.launch_id, node_id=launch_2.node_id, generation=0,
                           nodes=1, nproc_per_node=3)
    write_fault(os.path.join(base, "ctx"), 0, fault_for(binding, "sdc", [0], 3, 8, 6))
    out_3 = _out(base, "out-3")
    third = _launch(base, run_id, "3", nproc=2, args=[out_3, "12", "1", "7"])
    assert third.returncode == 0, third.stdout[-8000:]
    for name in ("worker-0.json", "worker-1.json", "worker-2.json"):
        assert f"{name}: it was recorded with LOCAL_WORLD_SIZE 3 (--nproc-per-node); this launch runs 2" \
            in third.stdout
    assert "generation 0, node slot 0 of 1: fresh, checkpoint step 0" in third.stdout
    assert f"fault-0.json: it was left by launch {launch_2.launch_id[:12]}" in third.stdout
    assert "RETIRED" not in third.stdout
    assert "generation 1, node slot 0 of 1: same-node restart, checkpoint step 6" in third.stdout
    resumed_2 = _final(out_3)
    assert resumed_2["start"] == 6

    baselines = {}
    for nproc in (3, 2):
        out = _out(base, f"clean-{nproc}")
        clean = _launch(base, f"clean{nproc}-{uuid.uuid4().hex[:8]}", f"clean-{nproc}", nproc=nproc, args=[out, "12"],
                        machine=f"clean-{nproc}", context=f"ctx-clean-{nproc}")
        assert clean.returncode == 0, clean.stdout[-6000:]
        baselines[nproc] = _final(out)
    assert not _differ(_final(out_2), baselines[3]), "the fresh restart is not bitwise equal to an uninterrupted run"
    assert not _differ(resumed_2, baselines[2]), "the resumed run is not bitwise equal to an uninterrupted run"


def _crash(agent) -> None:
    """SIGKILL an agent and the workers it started (torch starts each in a session of its own)."""
    workers = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == agent.pid:  # the parent pid
            workers.append(int(entry))
    L.stop(agent)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} did not die"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for_records(directory: str, workers: int, step: int, proc, log: str, timeout: float = 300) -> int:
    """Wait until every worker recorded a capture of `step` or later; the newest step all of them hold."""
    deadline = time.monotonic() + timeout
    while True:
        steps = []
        for rank in range(workers):
            try:
                with open(os.path.join(directory, f"worker-{rank}.json")) as f:
                    steps.append(json.load(f)["step"])
            except (OSError, ValueError):
                break
        if len(steps) == workers and min(steps) >= step:
            return min(steps)
        assert proc.returncode == -9 or proc.poll() is None, f"the agent ended early:\n{L.read_log(log)[-6000:]}"
        assert time.monotonic() < deadline, f"no capture of step {step} on every worker:\n{L.read_log(log)[-6000:]}"
        time.sleep(0.02)


def _doctor(path: str, generation: int, step: int, done: threading.Event, stop: threading.Event) -> None:
    """The audit's attack: the moment the agent writes `generation`'s context, replace it with a
    copy that names `step` (same user, mode 0600, schema-valid: only its bytes differ)."""
    while not stop.is_set():
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = None
        if doc is not None and doc.get("generation") == generation:
            doc["checkpoint_step"] = step
            temp = path + ".doctored"
            with open(temp, "w") as f:
                json.dump(doc, f)
            os.chmod(temp, 0o600)
            os.replace(temp, path)
            done.set()
            return
        time.sleep(0.005)


def test_a_copied_older_context_on_one_node_is_refused_and_the_run_ends_bitwise(tmp_path):
    """Issue 22, item 1, the audit's end-to-end case (about 5 minutes): two agents with 2 workers
    each; global rank 3 SIGKILLs itself after step 7, so generation 1 resumes step 6. The moment
    node b's agent writes its generation-1 context, it is replaced by one naming step 4 (which
    GEMINI still holds). Before the fix ranks resumed 6 and 4; now node b's workers refuse the
    context before their user module runs, the next generation resumes 6 on every rank, and the
    run ends bitwise equal to an uninterrupted one."""
    base = str(tmp_path)
    run_id = f"copied-{uuid.uuid4().hex[:8]}"
    out = _out(base, "out")
    done, stop = threading.Event(), threading.Event()
    doctor = threading.Thread(target=_doctor, args=(os.path.join(base, "ctx-b", "context.json"), 1, 4, done, stop),
                              daemon=True)
    doctor.start()
    agents = {}
    try:
        for name in ("a", "b"):
            agents[name] = _launch(base, run_id, name, nproc=2, max_restarts=2, nnodes="2:2", machine=name,
                                   context=f"ctx-{name}", args=[out, "12", "3", "7"], start_only=True)
        codes = {name: proc.wait(600) for name, (proc, _) in agents.items()}
    finally:
        stop.set()
        for proc, _ in agents.values():
            L.stop(proc)
    logs = {name: L.read_log(log) for name, (_, log) in agents.items()}
    assert codes == {"a": 0, "b": 0}, (codes, logs["b"][-6000:])
    assert done.is_set(), "the generation-1 context of node b was never replaced"
    assert "is not the one the agent wrote for generation 1 (its bytes changed since" in logs["b"]
    assert "at step 4" not in logs["a"] + logs["b"]
    assert re.search(r"generation 2, node slot \d of 2: same-node restart, checkpoint step 6", logs["b"])
    resumed = _final(out)
    assert resumed["start"] == 6
    clean_out = _out(base, "clean")
    clean_run = f"clean-{uuid.uuid4().hex[:8]}"
    clean = {}
    try:
        for name in ("x", "y"):
            clean[name] = _launch(base, clean_run, name, nproc=2, nnodes="2:2", machine=name, context=f"ctx-{name}",
                                  args=[clean_out, "12"], start_only=True)
        assert [proc.wait(500) for proc, _ in clean.values()] == [0, 0]
    finally:
        for proc, _ in clean.values():
            L.stop(proc)
    assert not _differ(resumed, _final(clean_out)), "not bitwise equal after the refused context"
    assert not glob.glob(os.path.join(base, "ctx-*", "*.doctored"))
