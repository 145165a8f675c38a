"""A zero-import FSDP2 training module for real torchrun agents (never imports lm_resiliency):

    torchrun ... --module tests.torchrun.fsdp_module OUT_DIR STEPS [KILL_RANK KILL_STEP]

Layers are sharded first, then the root (bottom-up). The loop starts at
LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP; batch i is a pure function of (i, rank). Every rank
writes OUT_DIR/final-<restart count>-<rank>.json: its shards' and optimizer state's bytes (hex)
and the step it started from. In a generation that started fresh, global rank KILL_RANK
SIGKILLs itself after optimizer step KILL_STEP.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def _hex(tensor: torch.Tensor) -> str:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()


def main() -> None:
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    kill_rank, kill_step = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (-1, -1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    for step in range(start, steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if start == 0 and rank == kill_rank and step + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
    tensors = {f"param/{name}": p for name, p in model.named_parameters()}
    for index, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optim/{index}/{key}": value for key, value in state.items()})
    final = {name: _hex(t) for name, t in sorted(tensors.items())}
    name = f"final-{os.environ.get('TORCHELASTIC_RESTART_COUNT')}-{rank}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump({"start": start, "tensors": final}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
