"""examples/torchrun_ddp.py's DDP loop (never imports lm_resiliency) with a hidden SDC: in a
generation that started fresh, global rank SDC_RANK silently corrupts one of its own weights
after optimizer step SDC_STEP (a bit flip in memory: training goes on, the all-reduce spreads it).

    torchrun ... --module tests.torchrun.sdc_ddp OUT_DIR STEPS [SDC_RANK SDC_STEP]

Every rank writes OUT_DIR/start-<pid>.json (the step its generation started
from); rank 0 writes OUT_DIR/final-<restart count>.json as the example does."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    sdc_rank, sdc_step = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (-1, -1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    with open(os.path.join(out_dir, f"start-{os.getpid()}.json"), "w") as f:
        json.dump({"start": start, "group_rank": int(os.environ["GROUP_RANK"])}, f)
    for step in range(start, steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(5, 8, generator=generator)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if start == 0 and rank == sdc_rank and step + 1 == sdc_step:
            with torch.no_grad():
                model[0].weight.view(-1)[3] += 0.5
    if rank == 0:
        tensors = {f"param/{name}": p for name, p in model.named_parameters()}
        for index, state in optimizer.state_dict()["state"].items():
            tensors.update({f"optim/{index}/{key}": value for key, value in state.items()
                            if isinstance(value, torch.Tensor)})
        final = {name: t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()
                 for name, t in sorted(tensors.items())}
        with open(os.path.join(out_dir, f"final-{restart}.json"), "w") as f:
            json.dump({"start": start, "tensors": final}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
