"""get_torchrun_worker_context: the agent's restart context, checked against torchrun's environment."""

from __future__ import annotations

import os

import pytest

from lm_resiliency.integrations.torchrun import (TorchrunWorkerAdapterError, TorchrunWorkerContext,
                                                 get_torchrun_worker_context)
from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.worker import load_worker_context


def _write(tmp_path, **changes) -> str:
    values = dict(run_id="run-1", node_id="ab" * 16, generation=3, slot=1, nodes=2,
                  topology_digest=ctx.topology_digest("run-1", 2), policy_digest="p" * 64, checkpoint_step=6,
                  checkpoint_source="gemini", decision="replacement")
    values.update(changes)
    directory = tmp_path / "ctx"
    ctx.ensure_private_dir(str(directory))
    path = str(directory / "context.json")
    ctx.write_context(path, ctx.RestartContext(**values))
    return path


def _env(path: str, **changes) -> dict:
    env = {ctx.CONTEXT_ENV: path, "TORCHELASTIC_RUN_ID": "run-1", "GROUP_RANK": "1", "LOCAL_RANK": "2",
           "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6"}
    env.update(changes)
    return env


def test_the_context_holds_the_generation_and_the_selected_step(tmp_path, monkeypatch):
    path = _write(tmp_path)
    for key, value in _env(path).items():
        monkeypatch.setenv(key, value)
    context = get_torchrun_worker_context()
    assert isinstance(context, TorchrunWorkerContext)
    assert (context.run_id, context.generation, context.slot, context.nodes, context.local_rank,
            context.local_world_size, context.checkpoint_step, context.checkpoint_source, context.decision) == (
        "run-1", 3, 1, 2, 2, 3, 6, "gemini", "replacement")
    assert context.context_path == path and context.node_id == "ab" * 16


@pytest.mark.parametrize("changes, message", [
    ({"TORCHELASTIC_RUN_ID": "run-2"}, "is for run 'run-1', this worker runs 'run-2'"),
    ({"GROUP_RANK": "0"}, "is for node slot 1, torchrun started this worker in slot 0"),
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 is not 2 nodes x LOCAL_WORLD_SIZE=3"),
    ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x'"),
    ({ctx.CONTEXT_ENV: ""}, "not started by a torchrun agent with --rdzv-backend=lm_resiliency"),
])
def test_a_context_that_does_not_match_the_worker_fails_closed(tmp_path, changes, message):
    with pytest.raises(TorchrunWorkerAdapterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_worker_context(_env(_write(tmp_path), **changes))


def test_corrupt_or_foreign_contexts_fail_closed(tmp_path):
    with pytest.raises(TorchrunWorkerAdapterError, match="topology digest does not match"):
        load_worker_context(_env(_write(tmp_path, topology_digest="0" * 32)))
    path = _write(tmp_path)
    with open(path, "w") as f:
        f.write('{"schema": "lm-resiliency-torchrun-context/2", "run_id": "run-1"}')
    with pytest.raises(TorchrunWorkerAdapterError, match="fields .* differ"):
        load_worker_context(_env(path))
    os.unlink(path)
    os.symlink(str(tmp_path / "elsewhere.json"), path)
    with pytest.raises(TorchrunWorkerAdapterError, match="cannot read the restart context"):
        load_worker_context(_env(path))
