"""FSDP2 (fully_shard on a 1-D CPU mesh) with lm-resiliency: one call, no loop changes; kill it and run it again.

    # trains 20 steps; every rank SIGKILLs itself after step 13
    torchrun --standalone --nproc-per-node 2 examples/pytorch_fsdp2.py --out /tmp/fsdp2-demo --kill-after 13
    # the same command without --kill-after resumes from GEMINI step 12 and finishes
    torchrun --standalone --nproc-per-node 2 examples/pytorch_fsdp2.py --out /tmp/fsdp2-demo

    python examples/pytorch_fsdp2.py --self-test   # runs both commands above and checks the resume
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lm_resiliency import InMemoryCkptConfig, enable_resiliency


def main(out: str, steps: int, kill_after: int | None) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # GEMINI captures each rank's local DTensor shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)

    resiliency = enable_resiliency(
        model, optimizer, scheduler=scheduler, interval=4,
        checkpoint=InMemoryCkptConfig(disk_folder=os.path.join(out, "gemini"), disk_flush_interval=4,
                                      run_id="fsdp2-example"),
    )
    if rank == 0:
        print(f"starting at step {resiliency.step_count}", flush=True)

    for step in range(resiliency.step_count, steps):
        data = torch.Generator().manual_seed(step * 10 + rank)
        loss = model(torch.randn(16, 32, generator=data)).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step + 1:3d}  loss {loss.item():.5f}  lr {scheduler.get_last_lr()[0]:.5f}", flush=True)
        if kill_after is not None and step + 1 == kill_after:
            resiliency.flush_for_restart()  # what a SIGTERM from the scheduler would also do
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


def self_test() -> int:
    import tempfile

    out = tempfile.mkdtemp(prefix="fsdp2-example-")
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.abspath(__file__), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(base + ["--kill-after", "13"], env=env, capture_output=True, text=True, timeout=300)
    print(first.stdout)
    second = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300)
    print(second.stdout)
    return 0 if second.returncode == 0 and "starting at step 12" in second.stdout else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/lm-resiliency-fsdp2-example")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    sys.exit(self_test() if args.self_test else main(args.out, args.steps, args.kill_after))
