"""Megatron Core training loops for test_worker_adapters_megatron.py, written as a zero-import
user writes them (no lm_resiliency call): the worker bootstrap is started first, as the shim
would, then the model chunks, get_megatron_optimizer() and the scheduler are built as
tests/frameworks/megatron_workloads.py builds them."""

from __future__ import annotations

import os
import sys
import types

from tests.torchrun.test_bootstrap import _bootstrap


def megatron_train(rank: int, world: int, directory: str, steps: int, selected: int = -1):
    """TP1 x DP3 with the distributed optimizer; `selected` >= 0: the generation the rendezvous
    told to load that step. Returns (step_count, recovered from, final state)."""
    from tests.frameworks.megatron_workloads import final_state, setup, train_step

    os.environ["LM_RESILIENCY_KEEP_SHARED_MEMORY"] = "1"  # slots outlive the workers, as under torchrun
    bootstrap = _bootstrap(directory, rank, world, max(selected, 0), "gemini" if selected >= 0 else "none")
    chunks, optimizer, scheduler = setup(1, distributed_optimizer=True)  # attaches at get_megatron_optimizer()
    for iteration in range(max(selected, 0), steps):  # LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP in a real worker
        train_step(chunks, optimizer, scheduler, iteration)
    session = bootstrap.session
    result = (session.step_count, session.recovered_from, final_state(chunks, optimizer, scheduler))
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # Megatron's teardown: the adapter closes the session first
    assert bootstrap.session is None
    return result


def megatron_refused(rank: int, world: int, directory: str, case: str) -> str:
    """A worker the adapter must refuse: "second optimizer" builds another Megatron optimizer over
    its chunks; "megatron-lm": rank 1 has Megatron-LM's megatron.training imported (a package that
    is not installed here; an empty module stands for its presence)."""
    from tests.frameworks.megatron_workloads import setup

    bootstrap = _bootstrap(directory, rank, world)
    if case == "megatron-lm" and rank == 1:
        sys.modules["megatron.training"] = types.ModuleType("megatron.training")
    try:
        chunks, _, _ = setup(1, distributed_optimizer=False)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), chunks)
    except Exception as exc:  # the test checks every rank's refusal
        return f"{type(exc).__name__}: {exc}"
    finally:
        bootstrap.close()
    return "not refused"


def megatron_without_scheduler(rank: int, world: int, directory: str, selected: int) -> str:
    """A generation that recovers a step captured with a scheduler, and builds none."""
    from tests.frameworks.megatron_workloads import setup, train_step

    os.environ["LM_RESILIENCY_KEEP_SHARED_MEMORY"] = "1"
    bootstrap = _bootstrap(directory, rank, world, selected, "gemini")
    chunks, optimizer, _ = setup(1, distributed_optimizer=True, scheduler=False)
    try:
        train_step(chunks, optimizer, None, selected)
    except Exception as exc:  # the test checks every rank's refusal
        return f"{type(exc).__name__}: {exc}"
    finally:
        bootstrap.close()
    return "not refused"
