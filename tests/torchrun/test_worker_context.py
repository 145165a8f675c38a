"""get_torchrun_worker_context: the agent's restart context, checked against what torchrun and the
agent gave the worker (its run, launch, node, generation, slot and topology, and the exact bytes
the agent wrote), in a directory and file only this user can change."""

from __future__ import annotations

import json
import os

import pytest

from lm_resiliency.integrations.torchrun import (TorchrunWorkerAdapterError, TorchrunWorkerContext,
                                                 get_torchrun_worker_context)
from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.worker import load_worker_context

LAUNCH = "1" * 32


def _context(**changes) -> ctx.RestartContext:
    values = dict(run_id="run-1", launch_id=LAUNCH, node_id="ab" * 16, generation=3, slot=1, nodes=2,
                  nproc_per_node=3, topology_digest=ctx.topology_digest("run-1", 2), policy_digest="p" * 64,
                  checkpoint_step=6, checkpoint_source="gemini", decision="replacement")
    values.update(changes)
    return ctx.RestartContext(**values)


def _write(tmp_path, **changes):
    """The context the agent wrote, and the environment it exported for its workers."""
    directory = tmp_path / "ctx"
    ctx.ensure_context_dir(str(directory))
    path = str(directory / "context.json")
    context = _context(**changes)
    return path, dict(ctx.context_environment(context, ctx.write_context(path, context)))


def _env(written, **changes) -> dict:
    path, exported = written
    env = {ctx.CONTEXT_ENV: path, "TORCHELASTIC_RUN_ID": "run-1", "GROUP_RANK": "1", "LOCAL_RANK": "2",
           "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6", **exported}
    env.update(changes)
    return env


def test_the_context_holds_the_generation_and_the_selected_step(tmp_path, monkeypatch):
    written = _write(tmp_path)
    for key, value in _env(written).items():
        monkeypatch.setenv(key, value)
    context = get_torchrun_worker_context()
    assert isinstance(context, TorchrunWorkerContext)
    assert (context.run_id, context.launch_id, context.generation, context.slot, context.nodes, context.local_rank,
            context.local_world_size, context.checkpoint_step, context.checkpoint_source, context.decision) == (
        "run-1", LAUNCH, 3, 1, 2, 2, 3, 6, "gemini", "replacement")
    assert context.context_path == written[0] and context.node_id == "ab" * 16
    assert os.stat(written[0]).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("changes, message", [
    ({"TORCHELASTIC_RUN_ID": "run-2"}, "is for run id 'run-1', but this worker belongs to 'run-2'"),
    ({ctx.LAUNCH_ENV: "2" * 32}, f"is for launch id '{LAUNCH}', but this worker belongs to '{'2' * 32}'"),
    ({ctx.NODE_ENV: "cd" * 16}, "is for node id 'abab"),
    ({ctx.GENERATION_ENV: "4"}, "is for generation 3, but this worker belongs to '4'"),
    ({ctx.GENERATION_ENV: ""}, "is for generation 3, but this worker belongs to ''"),
    ({"GROUP_RANK": "0"}, "is for node slot 1, torchrun started this worker in slot 0"),
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 is not 2 nodes x LOCAL_WORLD_SIZE=3"),
    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, "is for --nproc-per-node 3, torchrun started this worker with "
                                                   "LOCAL_WORLD_SIZE=2"),
    ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x'"),
    ({ctx.CONTEXT_ENV: ""}, "not started by a torchrun agent with --rdzv-backend=lm_resiliency"),
])
def test_a_context_that_does_not_match_the_worker_fails_closed(tmp_path, changes, message):
    with pytest.raises(TorchrunWorkerAdapterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_worker_context(_env(_write(tmp_path), **changes))


def test_a_worker_whose_agent_exported_nothing_refuses(tmp_path):
    env = _env(_write(tmp_path))
    del env[ctx.LAUNCH_ENV]
    with pytest.raises(TorchrunWorkerAdapterError, match="LM_RESILIENCY_TORCHRUN_LAUNCH_ID is not set"):
        load_worker_context(env)


def test_a_stale_or_edited_context_is_refused(tmp_path):
    """The audit's cases: an older generation's context copied over this one, and this one edited
    to name another step (same launch, generation and node: only the bytes differ)."""
    written = _write(tmp_path, generation=3)
    path, _ = written
    older = _context(generation=1, checkpoint_step=4)
    ctx.write_context(path, older)
    with pytest.raises(TorchrunWorkerAdapterError, match="is for generation 1, but this worker belongs to '3'"):
        load_worker_context(_env(written))
    ctx.write_context(path, _context(generation=3, checkpoint_step=4))
    with pytest.raises(TorchrunWorkerAdapterError, match="is not the one the agent wrote for generation 3 .*bytes "
                                                         "changed"):
        load_worker_context(_env(written))


def test_an_unsafe_context_file_or_directory_is_refused(tmp_path):
    written = _write(tmp_path)
    path, _ = written
    os.chmod(path, 0o666)
    with pytest.raises(TorchrunWorkerAdapterError, match="has mode 666; expected 0600 at most"):
        load_worker_context(_env(written))
    os.chmod(path, 0o600)
    os.chown(path, os.geteuid() + 4242, -1)
    with pytest.raises(TorchrunWorkerAdapterError, match=f"is owned by uid {os.geteuid() + 4242}"):
        load_worker_context(_env(written))
    os.chown(path, os.geteuid(), -1)
    load_worker_context(_env(written))
    os.chmod(os.path.dirname(path), 0o777)  # made world-writable after the agent checked it
    with pytest.raises(TorchrunWorkerAdapterError, match="has mode 0777: group/other access is not allowed"):
        load_worker_context(_env(written))
    os.chmod(os.path.dirname(path), 0o700)
    os.unlink(path)
    os.symlink(str(tmp_path / "elsewhere.json"), path)
    with pytest.raises(TorchrunWorkerAdapterError, match="is a symbolic link; refusing to follow it"):
        load_worker_context(_env(written))


def test_a_corrupt_context_is_refused(tmp_path):
    written = _write(tmp_path)
    path, _ = written
    with open(path, "w") as f:
        f.write(json.dumps({"schema": ctx.CONTEXT_SCHEMA, "run_id": "run-1"}))
    with pytest.raises(TorchrunWorkerAdapterError, match="missing keys"):
        load_worker_context(_env(written))
    doc = _context().to_json()
    for change, message in (({"slot": 2}, "slot 2 is not below nodes 2"),
                            ({"checkpoint_source": "none"}, "checkpoint_source 'none' \\(fresh\\) with checkpoint_step 6"),
                            ({"schema": "lm-resiliency-torchrun-context/2"}, "not a restart context of this version")):
        with open(path, "w") as f:
            f.write(json.dumps(dict(doc, **change)))
        with pytest.raises(TorchrunWorkerAdapterError, match=message):
            load_worker_context(_env(written))
    os.unlink(path)
    with pytest.raises(TorchrunWorkerAdapterError, match="the restart context does not exist"):
        load_worker_context(_env(written))
