"""A plain DDP training module that never imports lm_resiliency: under
`torchrun --rdzv-backend=lm_resiliency` with a worker policy it gets GEMINI with zero code
changes (docs/torchrun.md has the command).

    torchrun ... --module examples.torchrun_ddp OUT_DIR STEPS [KILL_RANK KILL_STEP [agent|hold]]

The loop starts at LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP, the step the rendezvous selected (the
bootstrap loads that step's model and optimizer state at the first DDP forward); batch i is a
pure function of (i, rank), so a resumed run sees the data it would have seen. Rank 0 writes
OUT_DIR/final-<restart count>.json: the bytes of every parameter and optimizer tensor (hex) and
the step it started from. Fault knobs for the tests: in a generation that started fresh, global rank
KILL_RANK SIGKILLs itself after optimizer step KILL_STEP ("agent": its torchrun agent first, so
the whole node is gone; "hold": instead it writes OUT_DIR/held-<rank> and waits there, for a test
that then crashes its host).
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    kill_rank, kill_step = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (-1, -1)
    kill_agent, hold = sys.argv[5:6] == ["agent"], sys.argv[5:6] == ["hold"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    for step in range(start, steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(5, 8, generator=generator)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if start == 0 and rank == kill_rank and step + 1 == kill_step:
            if hold:
                open(os.path.join(out_dir, f"held-{rank}"), "w").close()
                while True:
                    time.sleep(60)
            if kill_agent:
                os.kill(os.getppid(), signal.SIGKILL)
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
