"""Single-process PyTorch with lm-resiliency: crash it, start it again, it continues.

    python examples/pytorch_single.py --kill-after 13   # dies (SIGKILL) after step 13
    python examples/pytorch_single.py                   # resumes from GEMINI step 12

    python examples/pytorch_single.py --self-test       # both, checked
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency


def main(out: str, steps: int, kill_after: int | None) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen = {"samples": 0}

    resiliency = enable_resiliency(
        model, optimizer, interval=4,
        checkpoint=InMemoryCkptConfig(disk_folder=out, disk_flush_interval=4, run_id="single-example"),
        extra_state_fn=lambda: {"samples": seen["samples"]},           # your own loop state
        load_extra_state_fn=lambda extra: seen.update(samples=extra["samples"]),
    )
    print(f"starting at step {resiliency.step_count} ({seen['samples']} samples seen)", flush=True)
    for step in range(resiliency.step_count, steps):
        x = torch.randn(32, 8)                       # global RNG: restored with the checkpoint
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen["samples"] += 32
        print(f"step {step + 1:3d}  loss {loss.item():.5f}", flush=True)
        if kill_after is not None and step + 1 == kill_after:
            resiliency.flush_for_restart()
            os.kill(os.getpid(), signal.SIGKILL)
    return 0


def self_test() -> int:
    import tempfile

    out = tempfile.mkdtemp(prefix="single-example-")
    cmd = [sys.executable, os.path.abspath(__file__), "--out", out]
    print(subprocess.run(cmd + ["--kill-after", "13"], capture_output=True, text=True, timeout=120).stdout)
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    print(second.stdout)
    return 0 if second.returncode == 0 and "starting at step 12 (384 samples seen)" in second.stdout else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/lm-resiliency-single-example")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    sys.exit(self_test() if args.self_test else main(args.out, args.steps, args.kill_after))
