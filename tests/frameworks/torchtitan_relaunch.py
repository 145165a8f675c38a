"""A torchrun worker for tests/frameworks/test_torchtitan_relaunch.py: TorchTitan's real `Trainer`
(llama3 debug model, FSDP2 over the launched ranks, TorchTitan's own c4_test loader over a local
JSON dataset, `--checkpoint.no-enable`), launched as users launch it:

    torchrun --standalone --nproc-per-node 2 -m tests.frameworks.torchtitan_relaunch \
        --folder F --phase kill|resume|plain

`kill` and `resume` attach with `enable_resiliency(trainer, interval=2, enable_detection=False, ...)`
right before `trainer.train()`; in `kill`, rank `--kill-rank` SIGKILLs itself inside the optimizer
step of step `--kill-step` (a step post-hook of TorchTitan's inner optimizer: its parameters are
already updated in place, the step boundary is not reached). `plain` is the same trainer without
lm-resiliency. Each rank writes its final state (`{phase}-{rank}.pt`) and the loss TorchTitan logged
at each step it ran (`{phase}-{rank}.json`; `{phase}-{rank}.losses` as they are logged).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any, Dict

from tests.frameworks import torchtitan_cpu
from tests.frameworks.torchtitan_workloads import final_state

INTERVAL = 2


def build(folder: str, steps: int) -> Any:
    torchtitan_cpu.apply()
    config = torchtitan_cpu.debug_config(os.path.join(folder, "assets"), os.path.join(folder, "dump"), steps=steps)
    config.metrics.log_freq = 1  # TorchTitan computes and logs the global loss of every step
    # Without a seed, rank 0 draws one from torch's RNG, which differs from launch to launch under
    # torchrun: the plain run must start from the killed run's initial weights.
    config.debug.seed = 1234
    return config.build()


def record_losses(trainer: Any, journal: str) -> Dict[int, float]:
    """The global average loss TorchTitan's metrics processor logs, per step; also appended to
    `journal` as it is logged (a killed run leaves the losses of the steps it completed)."""
    losses: Dict[int, float] = {}
    original = trainer.metrics_processor.log

    def log(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
        losses[int(step)] = float(global_avg_loss)
        with open(journal, "a") as f:
            f.write(json.dumps([int(step), float(global_avg_loss)]) + "\n")
        return original(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = log
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--phase", choices=("kill", "resume", "plain"), required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--kill-step", type=int, default=11)
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    # The resilient launches share one run's folder; the plain run trains in its own.
    folder = os.path.join(args.folder, "plain" if args.phase == "plain" else "resilient")
    trainer = build(folder, args.steps)
    losses = record_losses(trainer, os.path.join(args.folder, f"{args.phase}-{rank}.losses"))
    session = None
    if args.phase != "plain":
        from lm_resiliency import InMemoryCkptConfig, enable_resiliency

        gemini = InMemoryCkptConfig(run_id="titan-relaunch", disk_folder=os.path.join(folder, "gemini"),
                                    shared_memory_dir=os.path.join(folder, "shm"), timeout_s=120.0)
        session = enable_resiliency(trainer, interval=INTERVAL, enable_detection=False, checkpoint=gemini)
    if args.phase == "kill" and rank == args.kill_rank:
        def kill(optimizer: Any, *unused: Any) -> None:
            if trainer.step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.optimizers.optimizers[0].register_step_post_hook(kill)
    first_step = int(trainer.step) + 1
    trainer.train()
    state = final_state(trainer)
    recovered_from = session.recovered_from if session is not None else None
    trainer.close()  # closes the session first

    import torch

    torch.save(state, os.path.join(args.folder, f"{args.phase}-{rank}.pt"))
    with open(os.path.join(args.folder, f"{args.phase}-{rank}.json"), "w") as f:
        json.dump({"first_step": first_step, "recovered_from": recovered_from,
                   "losses": {str(k): v for k, v in sorted(losses.items())}}, f)


if __name__ == "__main__":
    main()
