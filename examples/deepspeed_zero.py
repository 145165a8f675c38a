"""DeepSpeed ZeRO on CPU with lm-resiliency: one call after deepspeed.initialize(); kill it, run it again.

    # trains 12 steps on 2 CPU processes with ZeRO-3; every rank SIGKILLs itself right after step 7
    torchrun --standalone --nproc-per-node 2 examples/deepspeed_zero.py --stage 3 --out /tmp/ds-demo --kill-after 7
    # the same command without --kill-after resumes from GEMINI step 6 and finishes
    torchrun --standalone --nproc-per-node 2 examples/deepspeed_zero.py --stage 3 --out /tmp/ds-demo

    python examples/deepspeed_zero.py --self-test [--stage N]   # both commands above, plus an
                                                                 # uninterrupted run to compare with

The lm-resiliency settings live in the DeepSpeed config's "lm_resiliency" section, so the script
enables it with `enable_resiliency(engine)`. A DeepSpeed checkpoint is saved every 5 steps as the
durable fallback; it is loaded only when GEMINI recovered nothing (the first launch of a job, or
after losing every copy), and that load sets `resiliency.step_count` from `engine.global_steps`.
The first start compiles DeepSpeed's CPU comm op into TORCH_EXTENSIONS_DIR (minutes, once).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import subprocess
import sys

import torch
from torch import nn


def ds_config(stage: int, out: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},  # a torch optimizer
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
        "steps_per_print": 1_000_000,
        # Read by enable_resiliency(engine); DeepSpeed ignores keys it does not know.
        "lm_resiliency": {
            "interval": 2,
            "checkpoint": {"disk_folder": os.path.join(out, "gemini"), "disk_flush_interval": 2,
                           "run_id": f"deepspeed-example-zero{stage}"},
        },
    }


def digest(engine, stage: int) -> str:
    """SHA-256 over the full model and this rank's optimizer state (ZeRO: its partition)."""
    import deepspeed

    h = hashlib.sha256()

    def add(value) -> None:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().float().numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                add(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        add(params)
    add(engine.optimizer.state_dict())
    return h.hexdigest()[:16]


def main(out: str, stage: int, steps: int, kill_after: int | None) -> None:
    import deepspeed

    from lm_resiliency import enable_resiliency

    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 4))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(stage, out))
    samples = {"seen": 0}  # caller-owned state (what DeepSpeed calls client_state)

    resiliency = enable_resiliency(engine, extra_state_fn=lambda: {"samples": dict(samples)},
                                   load_extra_state_fn=lambda extra: samples.update(extra["samples"]))
    durable = os.path.join(out, "durable")
    if resiliency.recovered_from != "gemini" and os.path.exists(os.path.join(durable, "latest")):
        _, client_state = engine.load_checkpoint(durable)  # generation zero only; refused after a GEMINI recovery
        samples.update(client_state["samples"])
    if rank == 0:
        print(f"starting at step {resiliency.step_count} (recovered from {resiliency.recovered_from})", flush=True)

    while engine.global_steps < steps:  # engine.global_steps == resiliency.step_count
        step = engine.global_steps
        for micro in range(2):
            data = torch.Generator().manual_seed(step * 100 + micro * 10 + rank)
            loss = engine(torch.randn(8, 32, generator=data)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        samples["seen"] += 16
        if rank == 0:
            print(f"step {engine.global_steps:3d}  loss {loss.item():.5f}  lr {engine.get_lr()[0]:.5f}", flush=True)
        if engine.global_steps % 5 == 0:
            engine.save_checkpoint(durable, client_state={"samples": dict(samples)})
        if kill_after is not None and engine.global_steps == kill_after:
            resiliency.flush_for_restart()  # what a SIGTERM from the scheduler would also do
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"rank {rank} final digest {digest(engine, stage)} samples {samples['seen']}", flush=True)
    engine.destroy()  # closes the lm-resiliency session first (last capture, background threads)
    torch.distributed.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort it (docs/frameworks.md)


def self_test(stage: int) -> int:
    import tempfile

    root = tempfile.mkdtemp(prefix="deepspeed-example-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

    def run(out: str, *extra: str) -> str:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.abspath(__file__), "--stage", str(stage), "--out", out, *extra]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        print(done.stdout)
        return done.stdout

    def finals(text: str) -> list:  # ranks print concurrently: lines can interleave
        return sorted(re.findall(r"rank \d+ final digest \w+ samples \d+", text))

    reference = finals(run(os.path.join(root, "uninterrupted")))
    run(os.path.join(root, "managed"), "--kill-after", "7")
    resumed = run(os.path.join(root, "managed"))
    ok = ("starting at step 6 (recovered from gemini)" in resumed and len(reference) == 2
          and finals(resumed) == reference)
    print("OK: the killed run resumed from GEMINI step 6 and finished bitwise equal to the uninterrupted run."
          if ok else "FAILED: see the output above")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/lm-resiliency-deepspeed-example")
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    sys.exit(self_test(args.stage) if args.self_test else main(args.out, args.stage, args.steps, args.kill_after))
