"""Training loops for tests/torchrun/test_worker_adapters.py, written as a zero-import user
writes them (no lm_resiliency call): the worker bootstrap is started first, as the shim would."""

from __future__ import annotations

import os

import torch
from torch import nn

from tests.distributed.session_workloads import Stack
from tests.torchrun.test_bootstrap import _bootstrap


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 16, generator=torch.Generator().manual_seed(step * 1000 + rank))


def _local(value):
    return value.to_local().detach().clone() if hasattr(value, "to_local") else value.detach().clone()


def _state(model, optimizer) -> dict:
    state = {f"model.{k}": _local(v) for k, v in model.state_dict().items()}
    for index, values in optimizer.state_dict()["state"].items():
        state.update({f"optimizer.{index}.{k}": _local(v) for k, v in values.items()})
    state["rng"] = torch.get_rng_state()
    return state


def _sharded(world: int, shard_root: bool = True) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Stack()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:  # bottom-up, as users shard: layers first, then the root
        fully_shard(layer, mesh=mesh)
    if shard_root:
        fully_shard(model, mesh=mesh)
    return model


def fsdp_train(rank: int, world: int, directory: str, steps: int, selected: int = -1):
    """FSDP2 on a 1-D mesh; `selected` >= 0: the generation the rendezvous told to load that step."""
    bootstrap = _bootstrap(directory, rank, world, max(selected, 0), "gemini" if selected >= 0 else "none")
    model = _sharded(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(max(selected, 0), steps):  # LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP in a real worker
        loss = model(batch(step, rank)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    session = bootstrap.session
    result = (session.step_count, session.recovered_from, _state(model, optimizer))
    bootstrap.close()
    return result


def single_process(rank: int, world: int, directory: str, steps: int):
    """One process: the root module whose forward runs first, with an optimizer subclass defined
    after the bootstrap started."""
    bootstrap = _bootstrap(directory, rank, world)

    class ScaledSGD(torch.optim.SGD):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)
            self.scale = 1.0

    torch.manual_seed(0)
    model = Stack()
    loss_fn = nn.MSELoss()  # a second module forward each step, after the root's
    optimizer = ScaledSGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = loss_fn(model(batch(step, rank)), torch.zeros(5, 16))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    session = bootstrap.session
    result = (session.step_count, type(session.adapter.optimizer).__name__, session.adapter.model is model)
    bootstrap.close()
    return result


def refused(rank: int, world: int, directory: str, case: str) -> str:
    """A worker whose objects the native adapter must refuse; returns the error every rank raised."""
    bootstrap = _bootstrap(directory, rank, world)
    torch.manual_seed(0)
    if case == "unsharded root":
        model = _sharded(world, shard_root=False)
    elif case == "no optimizer":
        model = nn.parallel.DistributedDataParallel(Stack())
    else:  # "no boundary": a plain model trained in a distributed job
        model = Stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if case != "no optimizer" else None
    try:
        loss = model(batch(0, rank)).sum()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
    except Exception as exc:  # the test checks every rank's refusal
        return f"{type(exc).__name__}: {exc}"
    finally:
        bootstrap.close()
    return f"not refused (session: {bootstrap.session})"


def double_attach(rank: int, world: int, directory: str, explicit_first: bool):
    """User code that also calls enable_resiliency() in a worker under the worker policy."""
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    bootstrap = _bootstrap(directory, rank, world)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Stack())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def explicit() -> str:
        checkpoint = InMemoryCkptConfig(shared_memory_dir=os.path.join(directory, "explicit-shm"),
                                        disk_folder=os.path.join(directory, "explicit"), disk_flush_interval=0)
        try:
            enable_resiliency(ddp, optimizer, interval=2, enable_detection=False, checkpoint=checkpoint)
        except Exception as exc:  # the test checks the refusal
            return f"{type(exc).__name__}: {exc}"
        return "attached a second session"

    refusal = explicit() if explicit_first else ""
    for step in range(3):
        if step == 2 and not explicit_first:
            refusal = explicit()
        loss = ddp(batch(step, rank)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    step = bootstrap.session.step_count
    bootstrap.close()
    return refusal, step


def ds_train(rank: int, world: int, directory: str, steps: int, selected: int = -1, load: str = "",
             save: str = "", stage: int = 2):
    """A DeepSpeed ZeRO loop with no lm_resiliency call; `load`/`save`: a DeepSpeed checkpoint
    folder to load before the first step / save after the last. Returns (step_count, recovered
    from, engine.global_steps, the refusal of a load after the loop, final state)."""
    from tests.frameworks.deepspeed_workloads import build_engine, final_state, init_ranks, train_step

    os.environ["LM_RESILIENCY_KEEP_SHARED_MEMORY"] = "1"  # slots outlive the workers, as under torchrun
    bootstrap = _bootstrap(directory, rank, world, max(selected, 0), "gemini" if selected >= 0 else "none")
    init_ranks(rank)
    engine = build_engine(stage, rank)  # deepspeed.initialize(): the adapter attaches as it returns
    session = bootstrap.session
    if load:
        engine.load_checkpoint(load)
    for step in range(int(engine.global_steps), steps):
        train_step(engine, step, rank)
    if save:
        engine.save_checkpoint(save)
    refusal = ""
    if session.recovered_from == "gemini":
        try:
            engine.load_checkpoint(os.path.join(directory, "ds"))
        except Exception as exc:  # the test checks the refusal
            refusal = f"{type(exc).__name__}: {exc}"
    result = (session.step_count, session.recovered_from, int(engine.global_steps), refusal,
              final_state(engine, stage, {}))
    engine.destroy()  # DeepSpeed's teardown: the adapter closes the session first
    assert bootstrap.session is None
    return result


def ds_without_optimizer(rank: int, world: int, directory: str) -> str:
    from tests.frameworks.deepspeed_workloads import Net, ds_config, init_ranks

    import deepspeed

    bootstrap = _bootstrap(directory, rank, world)
    init_ranks(rank)
    try:
        deepspeed.initialize(model=Net(), config=ds_config(0, optimizer=False))
    except Exception as exc:  # the test checks every rank's refusal
        return f"{type(exc).__name__}: {exc}"
    finally:
        bootstrap.close()
    return "not refused"


def titan_train(rank: int, world: int, directory: str, steps: int, selected: int = -1):
    """TorchTitan's real Trainer (CPU patches, debug model, FSDP over all ranks), built and trained
    as train.py does; nothing calls lm_resiliency. Returns (first step trained, step_count,
    recovered from, final state)."""
    from tests.frameworks import torchtitan_cpu
    from tests.frameworks.torchtitan_workloads import final_state

    os.environ["LM_RESILIENCY_KEEP_SHARED_MEMORY"] = "1"
    bootstrap = _bootstrap(directory, rank, world, max(selected, 0), "gemini" if selected >= 0 else "none")
    torchtitan_cpu.apply()  # imports torchtitan: the TorchTitan worker adapter takes over
    config = torchtitan_cpu.debug_config(os.path.join(directory, "assets"), os.path.join(directory, "dump"),
                                         steps=steps)
    trainer = config.build()  # the adapter attaches as the Trainer's construction finishes
    first = trainer.step + 1
    trainer.train()
    session = bootstrap.session
    result = (first, session.step_count, session.recovered_from, final_state(trainer))
    trainer.close()  # TorchTitan's teardown: the session closes first
    assert bootstrap.session is None
    return result


def frameworks_differ(rank: int, world: int, directory: str) -> str:
    """Rank 1 imports TorchTitan, rank 0 does not; then the default process group initializes."""
    import torch.distributed as dist

    bootstrap = _bootstrap(directory, rank, world)
    if rank == 1:
        import torchtitan  # noqa: F401
    try:
        dist.init_process_group("gloo")
    except Exception as exc:  # the test checks every rank's refusal
        return f"{type(exc).__name__}: {exc}"
    finally:
        bootstrap.close()
    return "not refused"
