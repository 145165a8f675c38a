"""Hugging Face Accelerate with lm-resiliency: one `ResiliencyPlugin(...).attach(accelerator)` after
`prepare()`, the training loop unchanged (gradient accumulation included). Kill it; run it again.

    # 3 epochs of 5 micro-batches per rank, gradient_accumulation_steps=2 -> 9 optimizer steps;
    # every rank SIGKILLs itself after optimizer step 5
    torchrun --standalone --nproc-per-node 2 examples/accelerate_plugin.py --out /tmp/acc-demo --kill-after 5
    # the same command without --kill-after resumes after step 4 (mid-epoch 1) and finishes
    torchrun --standalone --nproc-per-node 2 examples/accelerate_plugin.py --out /tmp/acc-demo

    python examples/accelerate_plugin.py --self-test   # runs both commands above and checks the resume

    # the same with Accelerate's DeepSpeed integration (ZeRO-2): the same attach line hooks the engine
    python examples/accelerate_plugin.py --self-test --deepspeed 2

(On CPU use torchrun with `Accelerator(cpu=True)`; `accelerate launch --cpu --num_processes 2`
starts a single process. Accelerate switches DeepSpeed off for `cpu=True`, so with --deepspeed the
accelerator names the gloo backend instead; its DeepSpeedPlugin needs `transformers` installed.)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import torch
from accelerate import Accelerator

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.callbacks.accelerate import ResiliencyPlugin


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(64, 4)
        self.body = torch.nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def make_accelerator(zero_stage: int | None) -> Accelerator:
    if zero_stage is None:
        return Accelerator(cpu=True, gradient_accumulation_steps=2)
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    # DeepSpeed compiles its CPU comm op once; keep it next to the interpreter for later runs.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=zero_stage, gradient_accumulation_steps=2),
                       kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])


def main(out: str, epochs: int, kill_after: int | None, zero_stage: int | None) -> None:
    torch.manual_seed(0)
    accelerator = make_accelerator(zero_stage)
    data = torch.utils.data.TensorDataset(torch.randn(40, 32), torch.randn(40, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    # After prepare(): captures every 2 optimizer steps (never per micro-batch) and, on a restart,
    # restores model, optimizer, scheduler, RNG and the dataloader position before returning. Under
    # DeepSpeed the prepared optimizer's step() is a no-op: attach hooks the DeepSpeed engine instead.
    resiliency = ResiliencyPlugin(
        interval=2,
        checkpoint=InMemoryCkptConfig(disk_folder=os.path.join(out, "gemini"), disk_flush_interval=2,
                                      run_id="accelerate-example" + (f"-zero{zero_stage}" if zero_stage else "")),
    ).attach(accelerator)
    accelerator.print(f"starting after optimizer step {resiliency.step_count}")

    for epoch in range(epochs):          # unchanged: completed epochs of a resumed run yield nothing
        for x, y in loader:              # and the interrupted epoch continues where it stopped
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                accelerator.print(f"epoch {epoch} step {resiliency.step_count:2d}  loss {loss.item():.5f}")
                if kill_after is not None and resiliency.step_count == kill_after:
                    # Both ranks die after the same step, so the demo's resume point is fixed; in a real
                    # crash torchrun stops the other ranks anywhere, and the newest step every rank
                    # completed is recovered. Nothing is flushed or closed.
                    accelerator.wait_for_everyone()
                    os.kill(os.getpid(), signal.SIGKILL)
    accelerator.print(f"done after optimizer step {resiliency.step_count}")
    resiliency.close()
    if zero_stage is not None:
        # A process that imported DeepSpeed can abort at interpreter exit (gloo threads outlive the
        # process group; docs/frameworks.md): leave right after the cleanup.
        accelerator.end_training()
        sys.stdout.flush()
        os._exit(0)


def self_test(zero_stage: int | None) -> int:
    import tempfile

    out = tempfile.mkdtemp(prefix="accelerate-example-")
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.abspath(__file__), "--out", out]
    if zero_stage is not None:
        base += ["--deepspeed", str(zero_stage)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(base + ["--kill-after", "5"], env=env, capture_output=True, text=True, timeout=300)
    print(first.stdout)
    second = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300)
    print(second.stdout)
    # Normally the restart resumes after step 4. If another GEMINI job on this machine reaped the crashed
    # run's shared-memory slots first, it resumes from the newest flushed step instead (2 or 4).
    # Either way every step it repeats must print exactly the loss the crashed run printed.
    before = {line.split("loss")[0]: line for line in first.stdout.splitlines() if " loss " in line}
    again = [line for line in second.stdout.splitlines() if " loss " in line and line.split("loss")[0] in before]
    ok = (("starting after optimizer step 4" in second.stdout or "starting after optimizer step 2" in second.stdout)
          and "done after optimizer step 9" in second.stdout and again
          and all(before[line.split("loss")[0]] == line for line in again))
    print("OK: resumed at the last captured step and repeated the crashed run exactly" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/lm-resiliency-accelerate-example")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--deepspeed", type=int, choices=(1, 2, 3), default=None, metavar="ZERO_STAGE",
                        help="train under Accelerate's DeepSpeed integration with this ZeRO stage")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    sys.exit(self_test(args.deepspeed) if args.self_test else main(args.out, args.epochs, args.kill_after,
                                                                  args.deepspeed))
