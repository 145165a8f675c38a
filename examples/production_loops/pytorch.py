"""A plain DDP training loop, as a team writes it, for the README's production command:

    torchrun --rdzv-backend=lm_resiliency ... --module examples.production_loops.pytorch \
        --validation-output-dir /tmp/lm-resiliency-pytorch

It never imports lm_resiliency: the worker policy attaches GEMINI and SCOUT at the first DDP forward
and loads the checkpoint the rendezvous selected. The one line that knows about resilience reads
LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP (0 in a fresh run) to put the sampler back where that step
left it. At the end rank 0 writes `final-<restart count>.json` in the validation directory: the
step it started from and a SHA-256 of every parameter and optimizer tensor, so two runs compare
bitwise.
"""

import argparse
import hashlib
import itertools
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, CONTEXT, SAMPLES = 64, 16, 512


class TinyLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.mix = nn.Linear(32 * CONTEXT, 64)
        self.act = nn.GELU()
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.mix(self.embed(tokens).flatten(1))))


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (SAMPLES, CONTEXT + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, -1])


def state_digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    tensors = {f"param/{name}": p for name, p in model.named_parameters()}
    for index, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optim/{index}/{key}": value for key, value in state.items()
                        if isinstance(value, torch.Tensor)})
    return {name: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in sorted(tensors.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validation-output-dir", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLanguageModel()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    sampler = DistributedSampler(dataset(), shuffle=True, seed=0)
    loader = DataLoader(dataset(), batch_size=args.batch_size, sampler=sampler, drop_last=True)
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    step = start
    epoch, skip = divmod(start, len(loader))
    while step < args.steps:
        sampler.set_epoch(epoch)
        for tokens, target in itertools.islice(loader, skip, None):
            loss = nn.functional.cross_entropy(ddp(tokens), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:
                break
        epoch, skip = epoch + 1, 0
    if rank == 0:
        os.makedirs(args.validation_output_dir, exist_ok=True)
        name = f"final-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.json"
        with open(os.path.join(args.validation_output_dir, name), "w") as f:
            json.dump({"start": start, "steps": args.steps, "tensors": state_digests(model, optimizer)}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
