"""A training script shaped like pytorch/examples' DDP tutorial (`multigpu_torchrun.py`): a
`Trainer` that resumes from its own snapshot file at start (before wrapping the model in DDP),
epochs over a DataLoader with a DistributedSampler, a snapshot every `save_every` epochs. It never
imports lm_resiliency. Differences from the tutorial, none of which touch resuming: CPU and gloo,
a seeded dataset (the tutorial's `torch.rand` differs on every launch, so no two launches train on
the same data), an MSE loss (cross-entropy over one output is always zero), and the test knobs.

    torchrun ... --module tests.torchrun.tutorial_ddp OUT_DIR SNAPSHOT EPOCHS [edited] [KILL_RANK KILL_STEP]

`edited`: the one loop edit of docs/torchrun.md, "The one loop edit": start at
LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP, and skip the script's own snapshot resume when it is > 0.
KILL_RANK KILL_STEP: in torchrun's first generation, that global rank SIGKILLs itself after that
many optimizer steps. Rank 0 writes OUT_DIR/final-<restart count>.json: the start step, the steps
this generation ran and the bytes of every parameter (hex).
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(1234)
        self.size = size
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, edited):
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.steps = 0
        # The one loop edit: the step the rendezvous selected (0 in a fresh run).
        self.start_step = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0")) if edited else 0
        if os.path.exists(snapshot_path) and self.start_step == 0:
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        self.steps += 1

    def _run_epoch(self, epoch, skip):
        self.train_data.sampler.set_epoch(epoch)
        for index, (source, targets) in enumerate(self.train_data):
            if index < skip:
                continue  # the one loop edit: batches before the resumed step were trained already
            self._run_batch(source, targets)
            maybe_die(epoch * len(self.train_data) + index + 1)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        first_epoch, skip = divmod(self.start_step, len(self.train_data))
        for epoch in range(max(self.epochs_run, first_epoch), max_epochs):
            self._run_epoch(epoch, skip if epoch == first_epoch else 0)
            if dist.get_rank() == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


KILL = (-1, -1)


def maybe_die(step):
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and (dist.get_rank(), step) == KILL:
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    global KILL
    out_dir, snapshot_path, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rest = sys.argv[4:]
    edited = rest[:1] == ["edited"]
    rest = rest[1:] if edited else rest
    if rest:
        KILL = (int(rest[0]), int(rest[1]))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = MyTrainDataset(96)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_data = DataLoader(dataset, batch_size=8, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, train_data, optimizer, 1, snapshot_path, edited)
    trainer.train(epochs)
    if dist.get_rank() == 0:
        final = {name: p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()
                 for name, p in trainer.model.module.named_parameters()}
        path = os.path.join(out_dir, f"final-{os.environ.get('TORCHELASTIC_RESTART_COUNT')}.json")
        with open(path, "w") as f:
            json.dump({"start": trainer.start_step, "steps": trainer.steps, "tensors": final}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
