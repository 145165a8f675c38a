"""The `lm_resiliency` rendezvous backend in-process: registration, node identity, policy
agreement, restart-context permissions and standby parking, over torch's real FileStore."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from lm_resiliency.config import ConfigError
from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.backend import LMResiliencyRendezvousHandler, RendezvousRefused, StandbyReleased
from lm_resiliency.torchrun.identity import derive_torchrun_node_id, read_machine_id
from lm_resiliency.integrations.torchrun import create_rendezvous_handler, get_rendezvous_handler_creator
from tests.torchrun.launcher import POLICY, ROOT, machine_id_file, plugin_path


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _params(tmp_path, *, run_id: str, min_nodes: int = 1, max_nodes: int = 1, context: str = "ctx-a",
            policy: str = "", **extra: str) -> RendezvousParameters:
    config = {"store_type": "file", "join_timeout": "60", "last_call_timeout": "1",
              "lm_resiliency_restart_context_path": str(tmp_path / context / "context.json"), **extra}
    if policy:
        config["lm_resiliency_worker_config"] = policy
    return RendezvousParameters("lm_resiliency", str(tmp_path / "rdzv"), run_id, min_nodes, max_nodes, **config)


def _policy(tmp_path, name: str = "worker.toml", text: str = "") -> str:
    path = tmp_path / name
    path.write_text(text or POLICY.format(disk=str(tmp_path / "disk")))
    return str(path)


def _use_machine(tmp_path, name: str) -> None:
    os.environ["LM_RESILIENCY_MACHINE_ID_PATH"] = machine_id_file(str(tmp_path), name)


def test_the_entry_point_module_loads_before_torchs_rendezvous_package(tmp_path):
    # torch imports the entry point while its rendezvous package initializes; importing the
    # stable module first must not make that import circular (the plugin registers, no warning).
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
            "import lm_resiliency.integrations.torchrun\n"
            "from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry as r\n"
            "print(r._registry['lm_resiliency'].__module__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([plugin_path(str(tmp_path)), ROOT]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "lm_resiliency.torchrun.plugin"
    assert "Exception while registering out of tree plugin" not in done.stderr


def test_node_id_is_a_stable_hash_of_the_machine_id(tmp_path):
    _use_machine(tmp_path, "a")
    raw = read_machine_id()
    node = derive_torchrun_node_id()
    assert node == derive_torchrun_node_id(raw) and len(node) == 32 and raw not in node
    _use_machine(tmp_path, "b")
    assert derive_torchrun_node_id() != node
    (tmp_path / "bad").write_text("not-a-machine-id\n")
    os.environ["LM_RESILIENCY_MACHINE_ID_PATH"] = str(tmp_path / "bad")
    with pytest.raises(ValueError, match="does not hold a machine id"):
        derive_torchrun_node_id()
    os.environ["LM_RESILIENCY_MACHINE_ID_PATH"] = "relative/machine-id"
    with pytest.raises(ValueError, match="absolute path"):
        read_machine_id()


def test_registered_through_torchs_registry_under_its_own_name(tmp_path):
    _use_machine(tmp_path, "a")
    creator = get_rendezvous_handler_creator()
    assert creator is create_rendezvous_handler
    rendezvous_handler_registry.register("lm_resiliency", creator)  # what torch does with the entry point
    handler = get_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex))
    assert isinstance(handler, LMResiliencyRendezvousHandler)
    assert handler.get_backend() == "lm_resiliency"
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    written = ctx.read_context(str(tmp_path / "ctx-a" / "context.json"))[0]
    assert written.launch_id == handler.launch_id and written.nproc_per_node is None  # not called by an agent
    assert (written.generation, written.slot, written.nodes, written.checkpoint_step, written.checkpoint_source,
            written.decision) == (0, 0, 1, 0, "none", "fresh")
    assert written.node_id == derive_torchrun_node_id()
    handler.shutdown()


def test_restart_context_dir_is_owner_only_and_bad_ones_fail_closed(tmp_path):
    _use_machine(tmp_path, "a")
    create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex)).shutdown()
    assert os.stat(tmp_path / "ctx-a").st_mode & 0o777 == 0o700
    open_dir = tmp_path / "ctx-open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o750)
    with pytest.raises(RendezvousRefused, match="mode 0750: group/other access is not allowed"):
        create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex, context="ctx-open"))
    assert os.stat(open_dir).st_mode & 0o777 == 0o750  # never changed for the user
    foreign = tmp_path / "ctx-foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, os.geteuid() + 4242, -1)
    with pytest.raises(RendezvousRefused, match=f"owned by uid {os.geteuid() + 4242}, not this user"):
        create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex, context="ctx-foreign"))


def test_a_context_dir_opened_up_after_startup_stops_the_next_round(tmp_path):
    _use_machine(tmp_path, "a")
    handler = create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex))
    os.chmod(tmp_path / "ctx-a", 0o777)
    with pytest.raises(RendezvousRefused, match="has mode 0777: group/other access is not allowed"):
        handler.next_rendezvous()
    assert not os.path.exists(tmp_path / "ctx-a" / "context.json")  # nothing was written into it
    handler.shutdown()


def test_duplicate_machine_identity_fails_closed(tmp_path):
    run_id = uuid.uuid4().hex
    _use_machine(tmp_path, "a")
    first = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2))
    with pytest.raises(RendezvousRefused, match="already registered .* still alive: two agents share one machine id"):
        create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, context="ctx-b"))
    _use_machine(tmp_path, "b")
    second = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, context="ctx-b"))
    assert second.launch_id == first.launch_id  # a later agent joins the live launch
    first.shutdown()
    second.shutdown()


def test_a_relaunch_over_the_same_file_store_and_run_id_is_a_new_launch(tmp_path):
    """Issue 22, item 10: the endpoint file survives every launch (and a finished launch leaves
    torch's rendezvous closed in it); the next launch with the same --rdzv-id and machine id runs,
    in a launch of its own, once the previous agents stopped beating."""
    run_id = uuid.uuid4().hex
    _use_machine(tmp_path, "a")
    fast = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2"}
    first = create_rendezvous_handler(_params(tmp_path, run_id=run_id, **fast))
    assert first.next_rendezvous().rank == 0
    first.set_closed()
    first.shutdown()  # the run ended: its agent stops beating
    relaunch = create_rendezvous_handler(_params(tmp_path, run_id=run_id, **fast))
    assert relaunch.launch_id != first.launch_id
    assert relaunch.next_rendezvous().rank == 0 and not relaunch.is_closed()
    written = ctx.read_context(str(tmp_path / "ctx-a" / "context.json"))[0]
    assert (written.launch_id, written.generation) == (relaunch.launch_id, 0)  # rounds restart at 0
    relaunch._member.stop()  # killed, not shut down: its keep-alive stops with its process
    again = create_rendezvous_handler(_params(tmp_path, run_id=run_id, **fast))
    assert again.launch_id not in (first.launch_id, written.launch_id)
    again.shutdown()


def test_a_dead_agents_identity_is_taken_over_in_its_live_launch(tmp_path):
    run_id = uuid.uuid4().hex
    fast = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2"}
    _use_machine(tmp_path, "b")
    other = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=3, context="ctx-b", **fast))
    _use_machine(tmp_path, "a")
    dead = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=3, **fast))
    dead._member.stop()  # its process is gone; node b keeps the launch alive
    time.sleep(1.5)
    restarted = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=3, **fast))
    assert restarted.launch_id == other.launch_id == dead.launch_id
    other.shutdown()
    restarted.shutdown()


def test_a_malformed_launch_record_fails_closed(tmp_path):
    from torch.distributed import FileStore

    from lm_resiliency.torchrun.launches import run_store

    run_id = uuid.uuid4().hex
    run_store(FileStore(str(tmp_path / "rdzv")), run_id).set("launch", '{"schema": "x"}')
    _use_machine(tmp_path, "a")
    with pytest.raises(RendezvousRefused, match="store key lm_resiliency/.*/launch: not a launch record of this "
                                                "version.*remove the rendezvous file"):
        create_rendezvous_handler(_params(tmp_path, run_id=run_id))


def test_a_gemini_run_id_other_than_the_rdzv_id_is_refused(tmp_path, monkeypatch):
    """Issue 22, item 10: the agents key records, selection and faults by --rdzv-id; GEMINI under
    another run id would resume state they know nothing about."""
    _use_machine(tmp_path, "a")
    run_id = uuid.uuid4().hex
    named = _policy(tmp_path, "named.toml", POLICY.format(disk=str(tmp_path / "disk")) + 'run_id = "other"\n')
    with pytest.raises(RendezvousRefused, match=rf"\[checkpoint\] run_id in .*named.toml is 'other', but --rdzv-id is "
                                                rf"'{run_id}'.*--rdzv-id=other"):
        create_rendezvous_handler(_params(tmp_path, run_id=run_id, policy=named))
    same = _policy(tmp_path, "same.toml", POLICY.format(disk=str(tmp_path / "disk")) + f'run_id = "{run_id}"\n')
    create_rendezvous_handler(_params(tmp_path, run_id=run_id, policy=same)).shutdown()
    monkeypatch.setenv("LM_RESILIENCY_RUN_ID", "env-run")
    with pytest.raises(RendezvousRefused, match="LM_RESILIENCY_RUN_ID in the agent's environment is 'env-run'"):
        create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex, policy=_policy(tmp_path)))


def test_policy_digest_must_agree_and_bad_policies_fail_before_joining(tmp_path):
    run_id = uuid.uuid4().hex
    _use_machine(tmp_path, "a")
    first = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, policy=_policy(tmp_path)))
    _use_machine(tmp_path, "b")
    other = _policy(tmp_path, "other.toml", POLICY.format(disk=str(tmp_path / "disk")).replace("interval = 2",
                                                                                               "interval = 4"))
    with pytest.raises(RendezvousRefused, match="policy digest .* differs from the one run"):
        create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, context="ctx-b", policy=other))
    _use_machine(tmp_path, "c")
    with pytest.raises(RendezvousRefused, match="policy digest"):  # no policy at all is a mismatch too
        create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, context="ctx-c"))
    unknown = _policy(tmp_path, "unknown.toml", "schema_version = 1\ninterval = 2\nintervall = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['intervall'\]"):
        create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex, policy=unknown))
    versionless = _policy(tmp_path, "v.toml", "interval = 2\n")
    with pytest.raises(ConfigError, match="schema_version: expected 1, got nothing"):
        create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex, policy=versionless))
    flush = _policy(tmp_path, "f.toml", "schema_version = 1\n[checkpoint]\ndisk_flush_interval = -1\n")
    with pytest.raises(ConfigError, match="disk_flush_interval"):
        create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex, policy=flush))
    adapter = _policy(tmp_path, "a.toml", "schema_version = 1\nadapter = \"no-colon\"\n")
    with pytest.raises(ConfigError, match="adapter: expected"):
        create_rendezvous_handler(_params(tmp_path, run_id=uuid.uuid4().hex, policy=adapter))
    first.shutdown()


def test_the_first_min_nodes_are_active_and_a_later_agent_parks_until_the_run_closes(tmp_path):
    run_id = uuid.uuid4().hex
    _use_machine(tmp_path, "a")
    active = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, keep_alive_interval="1"))
    info = active.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    _use_machine(tmp_path, "b")
    standby = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, context="ctx-b",
                                                keep_alive_interval="1"))
    try:
        outcome: dict = {}

        def park() -> None:
            try:
                outcome["info"] = standby.next_rendezvous()
            except StandbyReleased as exc:
                outcome["exit"] = exc

        thread = threading.Thread(target=park, daemon=True)
        thread.start()
        time.sleep(4)
        assert thread.is_alive() and not outcome, "the standby joined instead of parking"
        assert active.num_nodes_waiting() == 0  # a parked standby does not restart the active group
        active.set_closed()
        thread.join(60)
        assert not thread.is_alive() and "exit" in outcome and outcome["exit"].code == 0  # not needed: status 0
        assert not os.path.exists(tmp_path / "ctx-b" / "context.json")  # it never ran a generation
    finally:
        standby.shutdown()
        active.shutdown()
