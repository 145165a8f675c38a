"""Accelerate training loops for tests/frameworks/test_accelerate.py (module level so child ranks
can import them), and, run as a script, a plain Accelerate training script that knows nothing of
lm-resiliency (the LM_RESILIENCY flag test launches it through the bootstrap).

The loop is the one Accelerate's docs show: `accelerator.accumulate(model)`, `accelerator.backward`,
a shuffled map-style dataset (Accelerate's synchronized sampler generator), an LR scheduler that
`AcceleratedScheduler` steps num_processes times, dropout and the global numpy/python RNG streams
(so RNG restore matters). 20 samples per rank in batches of 4 = 5 micro-batches per epoch; with
gradient_accumulation_steps=2 Accelerate syncs after micro-batches 2, 4 and 5 (end of dataloader),
so an epoch is 3 optimizer steps and 3 epochs are 9.
"""

import argparse
import os
import random
import signal
import sys

import numpy as np
import torch
from torch import nn

FEATURES = 32
SAMPLES = 40  # both ranks together


class Net(nn.Module):
    """Two bias-free layers, head registered first."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 4, bias=False)
        self.body = nn.Linear(FEATURES, 64, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.body(x))))


class ForwardNet(nn.Module):
    """The ordinary layout: layers then a head, registered in forward order; with
    `bucket_cap_mb=0.002` its gradients span three DDP buckets."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(FEATURES, FEATURES) for _ in range(3)])
        self.head = nn.Linear(FEATURES, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return self.head(x)


def dataset(samples=SAMPLES):
    g = torch.Generator().manual_seed(1234)
    return torch.utils.data.TensorDataset(torch.randn(samples, FEATURES, generator=g),
                                          torch.randn(samples, 4, generator=g))


def build(accum, forward=False):
    """The user's setup: seeds, Accelerator, model, optimizer, shuffled loader, scheduler, prepare().
    `forward`: ForwardNet over several DDP buckets, SAMPLES/2 samples per process at any world size."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    np.random.seed(rank)
    random.seed(rank)
    handlers = [DistributedDataParallelKwargs(bucket_cap_mb=0.002)] if forward else []
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum, kwargs_handlers=handlers)
    model = ForwardNet() if forward else Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    samples = SAMPLES // 2 * accelerator.num_processes if forward else SAMPLES
    loader = torch.utils.data.DataLoader(dataset(samples), batch_size=4, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def micro_step(accelerator, model, optimizer, scheduler, x, y):
    with accelerator.accumulate(model):
        # The global numpy and python RNG streams feed the data too: their restore is checked.
        noise = float(np.random.rand()) * 1e-3 + random.random() * 1e-3
        loss = (model(x + noise) - y).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def final_state(accelerator, model, optimizer, scheduler, loader):
    opt = optimizer.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "optimizer": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for i, s in opt["state"].items()},
        "param_groups": opt["param_groups"],
        "scheduler": scheduler.state_dict(),
        "accelerator_step": accelerator.step,
        "sampler_generator": (loader.synchronized_generator.get_state()
                              if loader.synchronized_generator is not None else None),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
    }


def train_with_plugin(rank, world, folder, run_id, epochs=3, accum=2, kill_after=None,
                      resume_dataloaders="auto", entry_point=False, forward=False):
    """ResiliencyPlugin attached after prepare() (`entry_point=True`: through
    lm_resiliency.integrations.accelerate.enable_resiliency instead). Returns (resumed step, captured
    steps, batches this process consumed, final state). `forward`: see `build`; LMR_TEST_DDP_PIN=0
    switches off the DDP bucket pin (adapters/_torch_compat.py), to show what it prevents."""
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.callbacks.accelerate import ResiliencyPlugin, get_session
    from lm_resiliency.integrations.accelerate import enable_resiliency

    if os.environ.get("LMR_TEST_DDP_PIN") == "0":
        from lm_resiliency import _torch_compat

        _torch_compat._ENABLED = False
    accelerator, model, optimizer, loader, scheduler = build(accum, forward)
    settings = dict(
        interval=2, resume_dataloaders=resume_dataloaders,
        # A private host-slot directory: GEMINI reaps dead runs' slots in its directory, and other
        # tests on this machine must not reap the killed run's slots before it restarts.
        checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id=run_id,
                                      replication_jump=1, timeout_s=60, shared_memory_dir=folder + ".shm"))
    if entry_point:
        session = enable_resiliency(accelerator, **settings)
        assert get_session(accelerator) is session
        plugin = accelerator.__dict__["_lm_resiliency_plugin"]
    else:
        plugin = ResiliencyPlugin(**settings)
        session = plugin.attach(accelerator)
    resumed = session.step_count
    captured = []
    save = session.manager.save
    session.manager.save = lambda state, step, **kw: (captured.append(step), save(state, step, **kw))[1]
    batches = 0
    start = plugin.resume_epoch if resume_dataloaders != "auto" else 0
    for epoch in range(start, epochs):
        if resume_dataloaders == "manual" and epoch == start:
            loader = plugin.skip_first_batches(loader)
        for x, y in loader:
            micro_step(accelerator, model, optimizer, scheduler, x, y)
            batches += 1
            if kill_after is not None and accelerator.sync_gradients and session.step_count == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing is flushed or closed
    state = final_state(accelerator, model, optimizer, scheduler, loader)
    steps = session.step_count
    plugin.close()
    return {"resumed": resumed, "captured": captured, "batches": batches, "steps": steps, "state": state}


def build_deepspeed(stage, accum=2):
    """The same setup under Accelerate's DeepSpeed integration (ZeRO `stage`, torch AdamW, a torch
    StepLR that Accelerate keeps as an AcceleratedScheduler since DeepSpeed only takes its own).

    Not `cpu=True`: Accelerate 1.15 turns DeepSpeed off for it (`AcceleratorState`: DEEPSPEED only
    "and not cpu"). On a CPU-only machine the engine runs on DeepSpeed's CPU accelerator anyway, and
    the gloo backend is named explicitly (the ranks' process group already exists)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    np.random.seed(rank)
    random.seed(rank)
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100  # weights partitioned, the small head persistent
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10_000}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def train_deepspeed(rank, world, stage, folder, run_id, kill_after=None, epochs=3):
    """ResiliencyPlugin under Accelerate's DeepSpeed integration; `folder=None` runs plain Accelerate +
    DeepSpeed. Returns what resumed, what was captured, how the steps were driven, and the final state
    (DeepSpeed's view: gathered and partitioned parameters, ZeRO optimizer state, engine counters;
    Accelerate's: scheduler, accelerator.step, sampler generator; the RNG streams)."""
    from tests.frameworks.deepspeed_workloads import final_state as engine_state, init_ranks

    init_ranks(rank)
    accelerator, model, optimizer, loader, scheduler = build_deepspeed(stage)
    out = {"resumed": None, "captured": [], "batches": 0}
    session = plugin = None
    if folder is not None:
        from lm_resiliency import InMemoryCkptConfig
        from lm_resiliency.callbacks.accelerate import ResiliencyPlugin

        plugin = ResiliencyPlugin(interval=2, checkpoint=InMemoryCkptConfig(
            disk_folder=folder, disk_flush_interval=2, run_id=run_id, replication_jump=1, timeout_s=60,
            shared_memory_dir=folder + ".shm"))
        session = plugin.attach(accelerator)
        out["resumed"] = session.step_count
        save = session.manager.save
        session.manager.save = lambda state, step, **kw: (out["captured"].append(step), save(state, step, **kw))[1]
    for epoch in range(epochs):
        for x, y in loader:
            micro_step(accelerator, model, optimizer, scheduler, x, y)
            out["batches"] += 1
            if kill_after is not None and accelerator.sync_gradients and session.step_count == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing is flushed or closed
    state = engine_state(model, stage, {})
    state.update(scheduler=scheduler.state_dict(), accelerator_step=accelerator.step,
                 sampler_generator=loader.synchronized_generator.get_state())
    out["state"] = state
    if plugin is not None:
        hooks = plugin.adapter._hooks
        inner = model.optimizer.optimizer  # the torch AdamW inside the ZeRO optimizer
        out["driven_by"] = {"adapter": type(plugin.adapter).__name__, "hooks": type(hooks).__name__,
                            "engine_steps": hooks.managed_steps, "step_count": session.step_count,
                            "global_steps": model.global_steps, "wrapper": type(optimizer).__name__,
                            "torch_optimizer_hooks": len(inner._optimizer_step_pre_hooks)
                            + len(inner._optimizer_step_post_hooks)}
        plugin.close()
    return out


def main(argv=None):
    """A plain Accelerate training script: no lm-resiliency anywhere. Saves its final state."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--crash-after-steps", type=int, default=None, help="simulate a crash (SIGKILL)")
    parser.add_argument("--forward", action="store_true", help="ForwardNet over several DDP buckets")
    args = parser.parse_args(argv)
    accelerator, model, optimizer, loader, scheduler = build(args.accum, args.forward)
    steps = batches = 0
    for epoch in range(args.epochs):
        for x, y in loader:
            micro_step(accelerator, model, optimizer, scheduler, x, y)
            batches += 1
            steps += int(accelerator.sync_gradients)
            if args.crash_after_steps is not None and steps == args.crash_after_steps:
                os.kill(os.getpid(), signal.SIGKILL)
    state = final_state(accelerator, model, optimizer, scheduler, loader)
    state["batches"] = batches
    state["patched_prepare"] = hasattr(type(accelerator).prepare, "_lm_resiliency_wrapped")
    state["lm_resiliency_imported"] = "lm_resiliency.adapters.accelerate" in sys.modules
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank{accelerator.process_index}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    accelerator.wait_for_everyone()


def run_script(rank, world, argv):
    """Child-rank entry for the flag tests: what `python -m lm_resiliency.callbacks.accelerate <this
    file> ARGS` does, in-process (the bootstrap's main), then the interpreter-exit handlers a normal
    exit would run (the harness ends children with os._exit)."""
    import atexit

    from lm_resiliency.callbacks import accelerate as bootstrap

    if os.environ.get("LMR_TEST_DDP_PIN") == "0":
        from lm_resiliency import _torch_compat

        _torch_compat._ENABLED = False
    bootstrap.main([os.path.abspath(__file__), *argv])
    atexit._run_exitfuncs()


if __name__ == "__main__":
    main()
