"""Megatron Core with lm-resiliency: one call after the model, optimizer and scheduler exist.

    # trains a small GPTModel (Megatron DDP, distributed optimizer, OptimizerParamScheduler) for 12
    # iterations; every rank SIGKILLs itself right after iteration 7
    torchrun --standalone --nproc-per-node 2 examples/megatron_gpt.py --out /tmp/mg-demo --kill-after 7
    # the same command without --kill-after resumes from GEMINI's iteration 6 and finishes
    torchrun --standalone --nproc-per-node 2 examples/megatron_gpt.py --out /tmp/mg-demo

Megatron Core trains on GPUs (NCCL). On a machine without one, add `--cpu`: it applies the test-only
CPU fixture (tests/frameworks/megatron_cpu.py) that replaces Megatron's CUDA calls, over gloo, in
fp32. That is for trying the example out, never for production.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist


def build(cpu: bool, tp: int):
    """What Megatron's setup_model_and_optimizer() returns: model chunks, optimizer, scheduler."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    precision = {} if cpu else dict(bf16=True, params_dtype=torch.bfloat16)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=cpu,
                               hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, **precision)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=16,
                     position_embedding_type="learned_absolute")
    if not cpu:
        model.cuda(torch.cuda.current_device())
    chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, clip_grad=1.0,
                                                       use_distributed_optimizer=True, **precision), chunks)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=1e-4, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=3,
                                        lr_decay_steps=12, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=12, wd_incr_style="constant")
    return chunks, optimizer, scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="GEMINI's node-local folder")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=None, help="SIGKILL every rank after this iteration")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--cpu", action="store_true", help="gloo + the test-only CPU fixture (no GPU)")
    args = parser.parse_args()
    if args.cpu:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.frameworks import megatron_cpu

        megatron_cpu.install()
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")

    from megatron.core import parallel_state

    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    chunks, optimizer, scheduler = build(args.cpu, args.tp)
    samples = {"consumed": 0}
    resiliency = enable_resiliency(
        chunks, optimizer, opt_param_scheduler=scheduler, interval=2,
        checkpoint=InMemoryCkptConfig(run_id="megatron-gpt-example", disk_folder=args.out),
        extra_state_fn=lambda: dict(samples), load_extra_state_fn=samples.update)
    iteration = resiliency.step_count  # Megatron: args.iteration = resiliency.step_count
    device = next(chunks[0].parameters()).device
    while iteration < args.iterations:
        generator = torch.Generator().manual_seed(iteration * 100 + parallel_state.get_data_parallel_rank())
        tokens = torch.randint(0, 128, (4, 16), generator=generator).to(device)
        positions = torch.arange(16, device=device).expand(4, 16)
        chunks[0].zero_grad_buffer()
        optimizer.zero_grad()
        loss = chunks[0](tokens, positions, attention_mask=None, labels=tokens).float().mean()
        loss.backward()
        chunks[0].finish_grad_sync()
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=1)
        iteration += 1
        samples["consumed"] += 4
        if dist.get_rank() == 0:
            print(f"iteration {iteration} loss {loss.item():.4f} grad_norm {grad_norm:.4f}", flush=True)
        if iteration == args.kill_after:
            resiliency.flush_for_restart()
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    resiliency.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
