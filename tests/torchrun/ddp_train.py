"""A DDP training module that never imports lm_resiliency (the zero-import torchrun workload).

    python -m torch.distributed.run ... --module tests.torchrun.ddp_train OUT_DIR STEPS [KILL_RANK KILL_STEP]

Starts at LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP (the bootstrap loads that step's state at the
first DDP forward). Batch i is a pure function of (i, rank). In the first generation, global rank
KILL_RANK SIGKILLs itself after optimizer step KILL_STEP. Rank 0 writes OUT_DIR/final.json: the
bytes of every parameter and optimizer tensor, hex, and the step it started from.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    kill_rank, kill_step = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (-1, -1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    for step in range(start, steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(5, 8, generator=generator)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if first_generation and rank == kill_rank and step + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        tensors = {f"param/{name}": p for name, p in model.named_parameters()}
        for index, state in optimizer.state_dict()["state"].items():
            tensors.update({f"optim/{index}/{key}": value for key, value in state.items()
                            if isinstance(value, torch.Tensor)})
        final = {name: t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()
                 for name, t in sorted(tensors.items())}
        with open(os.path.join(out_dir, f"final-{os.environ.get('TORCHELASTIC_RESTART_COUNT')}.json"), "w") as f:
            json.dump({"start": start, "tensors": final}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
