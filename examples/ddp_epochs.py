"""pytorch/examples' DDP tutorial loop (epochs over a DataLoader with a DistributedSampler, a
snapshot file every epoch) ported to lm-resiliency as docs/porting.md, "Epochs over a DataLoader",
describes: its snapshot resume moves into `load_fallback` (which runs after `DDP(...)`, so it
loads into `model.module`) and returns the step it resumed at; the loop starts at
`resiliency.step_count`, as an epoch and a batch within it; the dataset is seeded.

    # 3 ranks, 6 epochs of 4 steps; rank 1 SIGKILLs itself after step 11 (mid-epoch 2)
    torchrun --standalone --nproc-per-node 3 examples/ddp_epochs.py --out /tmp/ddp-epochs --kill-after 11
    # the same command without --kill-after resumes from GEMINI step 10 (epoch 2, batch 2) and finishes
    torchrun --standalone --nproc-per-node 3 examples/ddp_epochs.py --out /tmp/ddp-epochs

    python examples/ddp_epochs.py --self-test   # both, and an uninterrupted run: the final weights are bitwise equal
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from lm_resiliency import InMemoryCkptConfig, enable_resiliency


class MyTrainDataset(Dataset):
    def __init__(self, size: int) -> None:
        # Seeded: the tutorial's unseeded torch.rand builds other data on every launch (docs/porting.md).
        generator = torch.Generator().manual_seed(1234)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


def main(out: str, epochs: int, kill_after: int | None) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    dataset = MyTrainDataset(96)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    model = DDP(torch.nn.Linear(20, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    snapshot_path = os.path.join(out, "snapshot.pt")

    def load_snapshot():  # the tutorial's own resume, for when GEMINI has nothing (a new cluster, say)
        if not os.path.exists(snapshot_path):
            return None
        snapshot = torch.load(snapshot_path, weights_only=True)
        model.module.load_state_dict(snapshot["MODEL_STATE"])  # runs after DDP(...): the wrapped module
        optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        return (snapshot["EPOCHS_RUN"] + 1) * len(loader)     # the step it resumes at becomes step_count

    resiliency = enable_resiliency(model, optimizer, interval=2, load_fallback=load_snapshot,
                                   checkpoint=InMemoryCkptConfig(disk_folder=os.path.join(out, "gemini"),
                                                                 run_id="ddp-epochs"))
    first_epoch, skip = divmod(resiliency.step_count, len(loader))
    if rank == 0:
        print(f"starting at step {resiliency.step_count} (epoch {first_epoch}, batch {skip})", flush=True)
    step = resiliency.step_count
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        for index, (source, targets) in enumerate(loader):
            if epoch == first_epoch and index < skip:
                continue  # trained before the restart
            optimizer.zero_grad()
            F.mse_loss(model(source), targets).backward()
            optimizer.step()
            step += 1
            if kill_after is not None and step == kill_after and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0:
            torch.save({"MODEL_STATE": model.module.state_dict(), "OPTIMIZER_STATE": optimizer.state_dict(),
                        "EPOCHS_RUN": epoch}, snapshot_path)
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.module.parameters()))
        print(f"final weights sha256 {digest.hexdigest()}", flush=True)
    dist.destroy_process_group()


def self_test() -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch(out: str, *extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                   os.path.abspath(__file__), "--out", out, *extra]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        print(done.stdout, flush=True)
        return done

    killed, clean = tempfile.mkdtemp(prefix="ddp-epochs-"), tempfile.mkdtemp(prefix="ddp-epochs-clean-")
    launch(killed, "--kill-after", "11")
    resumed = launch(killed)
    baseline = launch(clean)
    final = [line for line in (resumed.stdout + baseline.stdout).splitlines() if line.startswith("final weights")]
    ok = ("starting at step 10 (epoch 2, batch 2)" in resumed.stdout and len(final) == 2 and final[0] == final[1])
    print("OK: the relaunch resumed mid-epoch and ended bitwise equal to the uninterrupted run" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/lm-resiliency-ddp-epochs")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    sys.exit(self_test() if args.self_test else main(args.out, args.epochs, args.kill_after))
