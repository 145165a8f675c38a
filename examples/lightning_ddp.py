"""Lightning DDP on CPU with lm-resiliency: one callback, no loop changes; kill it and run it again.

    # trains 12 steps on 2 CPU processes (Lightning starts the second one); every rank SIGKILLs
    # itself right after step 7
    python examples/lightning_ddp.py --out /tmp/lightning-demo --kill-after 7
    # the same command without --kill-after resumes from GEMINI step 6 and finishes
    python examples/lightning_ddp.py --out /tmp/lightning-demo

    python examples/lightning_ddp.py --self-test   # both commands above, plus an uninterrupted run
                                                   # to compare with, bitwise

The same program also runs under torchrun (`torchrun --nproc-per-node 2 examples/lightning_ddp.py
...`); torchrun's run id then identifies the run across its restarts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.callbacks.lightning import ResiliencyCallback


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 4, bias=False)
        self.body = nn.Linear(16, 64, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.body(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.global_rank == 0:
            print(f"step {self.global_step + 1:3d}  epoch {self.current_epoch}  loss {loss.item():.5f}", flush=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(80, 16, generator=g), torch.randn(80, 4, generator=g))
        return DataLoader(data, batch_size=4, shuffle=True)  # 10 batches per rank and epoch


class KillAfter(Callback):
    """Simulates a node failure: SIGKILL right after optimizer step `step` (nothing is flushed)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, steps: int, kill_after: int | None, resilient: bool) -> None:
    L.seed_everything(0, verbose=False)
    callbacks = []
    resiliency = None
    if resilient:
        resiliency = ResiliencyCallback(
            interval=2, run_id="lightning-ddp-example",
            # shared_memory_dir: host slots survive the SIGKILL there. Production keeps the /dev/shm
            # default; a private directory keeps other jobs on a shared test machine from reaping them.
            checkpoint=InMemoryCkptConfig(disk_folder=os.path.join(out, "gemini"), disk_flush_interval=4,
                                          replication_jump=1, shared_memory_dir=os.path.join(out, "shm")))
        callbacks.append(resiliency)
    if kill_after is not None:
        callbacks.append(KillAfter(kill_after))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out)
    model = Regressor()
    trainer.fit(model)
    if trainer.global_rank == 0:
        if resiliency is not None:
            recovered = resiliency.recovered_step
            print("started fresh" if recovered is None else f"resumed from GEMINI step {recovered}", flush=True)
        digest = hashlib.sha256()
        for value in list(model.state_dict().values()) + [
                t for s in trainer.optimizers[0].state_dict()["state"].values() for t in s.values()]:
            digest.update(value.detach().numpy().tobytes())
        print(f"final state sha256 {digest.hexdigest()}", flush=True)


def self_test() -> int:
    import tempfile

    out = tempfile.mkdtemp(prefix="lightning-example-")
    base = [sys.executable, os.path.abspath(__file__), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(*extra: str) -> str:
        done = subprocess.run(base + list(extra), env=env, capture_output=True, text=True, timeout=300)
        print(done.stdout)
        if done.returncode not in (0, -signal.SIGKILL):
            print(done.stderr[-3000:])
        return done.stdout

    run("--kill-after", "7")
    resumed = run()
    uninterrupted = run("--uninterrupted", "--out", os.path.join(out, "uninterrupted"))

    def digest(text: str) -> str:
        return next((line for line in text.splitlines() if line.startswith("final state sha256")), "missing")

    ok = "resumed from GEMINI step 6" in resumed and digest(resumed) == digest(uninterrupted) != "missing"
    print("OK: the resumed run is bitwise equal to the uninterrupted run." if ok else
          "FAILED: the resumed run differs from the uninterrupted run.")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/lm-resiliency-lightning-example")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--uninterrupted", action="store_true", help="train without lm-resiliency (reference)")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        sys.exit(self_test())
    main(args.out, args.steps, args.kill_after, not args.uninterrupted)
