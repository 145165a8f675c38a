"""The worker bootstrap on real gloo ranks (the shim's `start()` minus the environment): it
attaches at the first DDP forward only when every rank owns exactly one DDP model and its one
optimizer, records captured steps for the agent, and refuses state the agents did not select."""

from __future__ import annotations

import json
import os

from tests.harness import run_ranks


def _bootstrap(directory: str, rank: int, world_size: int, step: int = 0, source: str = "none", generation: int = 0,
               refused=()):
    from lm_resiliency.config import InMemoryCkptConfig
    from lm_resiliency.torchrun.bootstrap import WorkerBootstrap
    from lm_resiliency.torchrun.context import topology_digest
    from lm_resiliency.torchrun.policy import WorkerPolicy
    from lm_resiliency.torchrun.worker import TorchrunWorkerContext

    context = TorchrunWorkerContext(
        run_id="bootstrap-test", launch_id="1" * 32, node_id="n" * 32, local_rank=rank, local_world_size=world_size,
        generation=generation, slot=0, nodes=1, nproc_per_node=world_size,
        topology_digest=topology_digest("bootstrap-test", 1), policy_digest="d", checkpoint_step=step,
        checkpoint_source=source, decision="fresh", refused_steps=tuple(refused),
        context_path=os.path.join(directory, "context.json"))
    checkpoint = InMemoryCkptConfig(shared_memory_dir=os.path.join(directory, "shm"), run_id=f"bootstrap-{os.path.basename(directory)}",
                                    disk_folder=os.path.join(directory, "disk"), disk_flush_interval=0,
                                    timeout_s=30.0)
    policy = WorkerPolicy("worker.toml", "d", {"interval": 2, "enable_detection": False, "checkpoint": checkpoint})
    bootstrap = WorkerBootstrap(context, policy)
    bootstrap.install()
    return bootstrap


def _train(rank: int, world_size: int, directory: str, optimizers: int, steps: int, selected: int = -1,
           generation: int = 0, refused=()):
    import torch
    from torch import nn

    bootstrap = _bootstrap(directory, rank, world_size, max(selected, 0), "gemini" if selected >= 0 else "none",
                           generation, refused)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    extra = [torch.optim.SGD(ddp.parameters(), lr=0.1) for _ in range(optimizers - 1)]
    try:
        for step in range(steps):
            loss = ddp(torch.full((3, 4), float(rank + step))).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    except Exception as exc:  # returned to the test: every rank must raise the same refusal
        return f"{type(exc).__name__}: {exc}"
    finally:
        del extra
    step = bootstrap.session.step_count
    bootstrap.close()
    return step


def test_attaches_at_the_first_ddp_forward_and_records_captured_steps(tmp_path):
    assert run_ranks(_train, 3, str(tmp_path), 1, 5, timeout=240) == [5, 5, 5]
    for rank in range(3):
        with open(tmp_path / f"worker-{rank}.json") as f:
            record = json.load(f)
        # Captures at 2 and 4; step 4's was complete when step 5 began (the session waits for it).
        assert (record["step"], record["run_id"], record["local_world_size"]) == (4, "bootstrap-test", 3)


def test_two_optimizers_fail_closed_on_every_rank_before_attaching(tmp_path):
    results = run_ranks(_train, 3, str(tmp_path), 2, 1, timeout=240)
    for result in results:
        assert result.startswith("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: not attaching")
        assert all(f"rank {r}: 2 optimizers exist" in result for r in range(3))
    assert not any(name.startswith("worker-") for name in os.listdir(tmp_path))


KEEP = {"LM_RESILIENCY_KEEP_SHARED_MEMORY": "1"}  # slots outlive the workers, as under a restarting supervisor


def _records(directory) -> list:
    found = []
    for rank in range(3):
        with open(os.path.join(directory, f"worker-{rank}.json")) as f:
            record = json.load(f)
        found.append((record["generation"], record["step"], record["refused_steps"]))
    return found


def test_only_the_selected_step_is_loaded(tmp_path):
    # The first run captures steps 2 and 4 under a stable run id and keeps them in shared memory.
    assert run_ranks(_train, 3, str(tmp_path), 1, 5, timeout=240, env=KEEP) == [5, 5, 5]
    # A step that was never captured is not replaced by the newest one (4): nothing is loaded.
    for result in run_ranks(_train, 3, str(tmp_path), 1, 1, 3, 1, timeout=240, env=KEEP):
        assert result.startswith("RecoveryUnavailable: GEMINI step 3 was selected for recovery but is not loadable")
    # Every worker recorded what every rank can load instead (4), and that 3 was refused: the next
    # generation's agents select 4, never 3 again (issue 22, item 3).
    assert _records(tmp_path) == [(1, 4, [3])] * 3
    # The agents' accumulated refusals stay refused: with 4 refused too, nothing newer than 2 is offered.
    for result in run_ranks(_train, 3, str(tmp_path), 1, 1, 3, 2, (4,), timeout=240, env=KEEP):
        assert result.startswith("RecoveryUnavailable")
    assert _records(tmp_path) == [(2, 2, [3, 4])] * 3
    # The selected older step (2) is loaded exactly, although 4 is newer; training goes on from it.
    assert run_ranks(_train, 3, str(tmp_path), 1, 1, 2, 3, timeout=240, env=KEEP) == [3, 3, 3]


def test_state_the_agents_did_not_select_is_refused(tmp_path):
    assert run_ranks(_train, 3, str(tmp_path), 1, 5, timeout=240, env=KEEP) == [5, 5, 5]
    # A "fresh" generation of the same run finds GEMINI state no agent recorded: it stops, and
    # records that step for the agents, so the next generation starts from it.
    for result in run_ranks(_train, 3, str(tmp_path), 1, 1, -1, 1, timeout=240, env=KEEP):
        assert "GEMINI resumed step 4" in result and "selected a fresh start" in result
    assert _records(tmp_path) == [(1, 4, [])] * 3
    assert run_ranks(_train, 3, str(tmp_path), 1, 2, 4, 2, timeout=240, env=KEEP) == [6, 6, 6]  # from 4, 2 steps
