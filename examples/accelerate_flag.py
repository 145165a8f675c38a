"""A plain Accelerate training script (no lm-resiliency import) made resilient by a flag.

Accelerate has no third-party plugin seam, so the flag is an environment variable read by a
launcher bootstrap that runs the unchanged script:

    export LM_RESILIENCY=1 LM_RESILIENCY_INTERVAL=2 LM_RESILIENCY_DIR=/tmp/acc-flag LM_RESILIENCY_RUN_ID=flag-demo
    # crashes (SIGKILL) after optimizer step 7
    torchrun --standalone --nproc-per-node 2 -m lm_resiliency.callbacks.accelerate \
        examples/accelerate_flag.py --out /tmp/acc-flag/crashed --crash-after 7
    # the same command, no crash: resumes after step 6 and finishes
    torchrun --standalone --nproc-per-node 2 -m lm_resiliency.callbacks.accelerate \
        examples/accelerate_flag.py --out /tmp/acc-flag/resumed

    # on GPUs: LM_RESILIENCY=1 accelerate launch -m lm_resiliency.callbacks.accelerate examples/accelerate_flag.py ...
    # unset LM_RESILIENCY (or 0): the bootstrap only runs the script

    python examples/accelerate_flag.py --self-test   # runs it without the flag, then crashed + resumed
                                                      # with it, and checks the final weights are identical
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import torch
from accelerate import Accelerator


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(64, 4)
        self.body = torch.nn.Linear(32, 64)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.body(x))))


def main(out: str, epochs: int, crash_after: int | None) -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    data = torch.utils.data.TensorDataset(torch.randn(40, 32), torch.randn(40, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    steps = 0
    for epoch in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps += 1
                accelerator.print(f"epoch {epoch}  loss {loss.item():.5f}")
                if crash_after is not None and steps == crash_after:
                    accelerator.wait_for_everyone()  # both ranks die after the same step
                    os.kill(os.getpid(), signal.SIGKILL)
    accelerator.print(f"this process ran {steps} optimizer steps")
    if accelerator.is_main_process:
        os.makedirs(out, exist_ok=True)
        torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(out, "final.pt"))
    accelerator.wait_for_everyone()


def self_test() -> int:
    import tempfile

    out = tempfile.mkdtemp(prefix="accelerate-flag-example-")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "lm_resiliency.callbacks.accelerate", os.path.abspath(__file__)]
    plain = dict(os.environ, OMP_NUM_THREADS="1", LM_RESILIENCY="0")
    flag = dict(plain, LM_RESILIENCY="1", LM_RESILIENCY_INTERVAL="2", LM_RESILIENCY_DISK_FLUSH_INTERVAL="2",
                LM_RESILIENCY_DIR=os.path.join(out, "gemini"), LM_RESILIENCY_RUN_ID="accelerate-flag-example")
    runs = [("uninterrupted, flag off", plain, ["--out", os.path.join(out, "plain")]),
            ("crashed, flag on", flag, ["--out", os.path.join(out, "crashed"), "--crash-after", "7"]),
            ("restarted, flag on", flag, ["--out", os.path.join(out, "resumed")])]
    for title, env, args in runs:
        done = subprocess.run(launch + args, env=env, capture_output=True, text=True, timeout=300)
        print(f"--- {title}\n{done.stdout}")
    plain_final = torch.load(os.path.join(out, "plain", "final.pt"))
    resumed_final = torch.load(os.path.join(out, "resumed", "final.pt"))
    same = all(torch.equal(plain_final[k], resumed_final[k]) for k in plain_final)
    print("OK: the crashed-and-restarted run ended bitwise equal to the uninterrupted one" if same
          else "FAILED: the final weights differ")
    return 0 if same else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/lm-resiliency-accelerate-flag")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--crash-after", type=int, default=None)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    sys.exit(self_test() if args.self_test else main(args.out, args.epochs, args.crash_after))
