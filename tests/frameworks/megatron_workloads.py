"""Rank functions for test_megatron.py: a small Megatron Core GPTModel, Megatron's DDP, optimizer
and scheduler, built the way `setup_model_and_optimizer()` builds them, on gloo with the CPU
fixture of megatron_cpu.py."""

from __future__ import annotations

import os
import signal
from typing import Optional

import torch
import torch.distributed as dist

from tests.frameworks import megatron_cpu

VOCAB, SEQ, BATCH = 64, 8, 2


def setup(tp: int, distributed_optimizer: bool, seed: int = 1234, cuda: bool = False, scheduler: bool = True,
          loss_scale: Optional[float] = None):
    """(model chunks, optimizer, scheduler) after initialize_model_parallel(tp); on CPU in fp32 with
    the CPU fixture, or with `cuda` in bf16 on the rank's GPU as Megatron runs in production.
    Without `scheduler`, None for it. `loss_scale` (with the distributed optimizer): Megatron's
    constant grad scaler, which checks the gradients for inf/NaN and skips such updates."""
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        megatron_cpu.install()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)
    precision = dict(bf16=True, params_dtype=torch.bfloat16) if cuda else {}
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=not cuda,
                               hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, **precision)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="learned_absolute")
    if cuda:
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    chunks = [DistributedDataParallel(config, ddp_config, model)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01, clip_grad=0.05,
                        use_distributed_optimizer=distributed_optimizer, loss_scale=loss_scale, **precision), chunks)
    if not scheduler:
        return chunks, optimizer, None
    return chunks, optimizer, OptimizerParamScheduler(
        optimizer, init_lr=1e-3, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=20,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=20, wd_incr_style="constant")


def train_step(chunks, optimizer, scheduler, iteration: int, poison: bool = False) -> bool:
    """One Megatron training iteration; data differs per data-parallel rank and iteration. `poison`
    makes the gradients non-finite (an fp16 overflow): a grad scaler skips the update."""
    from megatron.core import parallel_state

    generator = torch.Generator().manual_seed(1000 * iteration + parallel_state.get_data_parallel_rank())
    device = next(chunks[0].parameters()).device
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)
    positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss = chunks[0](tokens, positions, attention_mask=None, labels=tokens).float().mean()
    if poison:
        loss = loss * float("inf")
    loss.backward()
    for chunk in chunks:
        chunk.finish_grad_sync()
    update_successful, _, _ = optimizer.step()
    if update_successful and scheduler is not None:
        scheduler.step(increment=1)
    return update_successful


def final_state(chunks, optimizer, scheduler) -> dict:
    from lm_resiliency.adapters.megatron import leaf_optimizers

    leaves = leaf_optimizers(optimizer)
    return {
        "model": {n: p.detach().cpu().clone() for c in chunks for n, p in c.named_parameters()},
        "main_params": [p.detach().cpu().clone() for leaf in leaves for g in leaf.optimizer.param_groups
                        for p in g["params"]],
        "optimizer": [{i: {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in per_param.items()}
                       for i, per_param in torch.optim.Optimizer.state_dict(leaf.optimizer)["state"].items()}
                      for leaf in leaves],
        "lr": [g["lr"] for leaf in leaves for g in leaf.optimizer.param_groups],
        "scheduler": scheduler.state_dict(),
    }


def kill_resume(rank, world, folder, tp, distributed_optimizer, steps, kill_after=None, nccl_store=None,
                iteration=0):
    """Train to `steps` with lm-resiliency (interval 2); at `kill_after` flush, then SIGKILL rank 1
    (rank 0 alone; the others stop without closing). Returns (resumed step, final state, samples).
    With `nccl_store` (a fresh file path) it runs on CUDA over NCCL, in bf16, without the fixture.
    `iteration`: what Megatron's own checkpoint would have loaded (enable_resiliency(iteration=...))."""
    cuda = nccl_store is not None
    if cuda:
        dist.init_process_group("nccl", init_method=f"file://{nccl_store}", rank=rank, world_size=world)
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.integrations.megatron import enable_resiliency

    chunks, optimizer, scheduler = setup(tp, distributed_optimizer, cuda=cuda)
    counter = {"samples": 0}
    resiliency = enable_resiliency(
        chunks, optimizer, opt_param_scheduler=scheduler, interval=2, enable_detection=False, iteration=iteration,
        checkpoint=InMemoryCkptConfig(run_id="megatron-test", disk_folder=folder, disk_flush_interval=2,
                                      shared_memory_dir=os.path.join(folder, "shm"), timeout_s=60),
        extra_state_fn=lambda: {"samples": counter["samples"]},
        load_extra_state_fn=lambda extra: counter.update(samples=extra["samples"]))
    resumed = iteration = resiliency.step_count  # what args.iteration is set to
    while iteration < steps:
        train_step(chunks, optimizer, scheduler, iteration)
        iteration += 1
        counter["samples"] += BATCH
        assert resiliency.step_count == iteration
        if iteration == kill_after:
            resiliency.flush_for_restart()
            dist.barrier()
            if rank == min(1, world - 1):
                os.kill(os.getpid(), signal.SIGKILL)
            return None
    state = final_state(chunks, optimizer, scheduler)
    resiliency.close()
    return resumed, state, counter["samples"]


def topology(rank, world, tp):
    """The adapter's topology after initialize_model_parallel(tp), and SCOUT's replay checks over
    iterations 5 and 6 (interval 2: every check class runs at iteration 6)."""
    from lm_resiliency import enable_resiliency
    from lm_resiliency.scout.peers import peer_groups_from_topology

    chunks, optimizer, scheduler = setup(tp, distributed_optimizer=True)
    faults = []
    # As if Megatron had loaded its own checkpoint of iteration 4: with no GEMINI state, count on from it.
    resiliency = enable_resiliency(chunks, optimizer, opt_param_scheduler=scheduler, interval=2, iteration=4,
                                   enable_checkpoint=False, fault_callback=faults.append)
    for iteration in range(4, 6):
        train_step(chunks, optimizer, scheduler, iteration)
    descriptor = resiliency.adapter.topology().descriptor
    groups = peer_groups_from_topology(descriptor, world)
    result = resiliency.last_replay_result
    checks = [(c.check, c.verdict, tuple(c.group_ranks)) for c in result.checks] if result is not None else None
    out = (descriptor, groups, resiliency.step_count, resiliency.adapter.describe(), checks, len(faults))
    resiliency.close()
    return out
