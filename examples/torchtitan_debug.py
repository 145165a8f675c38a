"""TorchTitan's llama3 debug model with lm-resiliency, switched on from the command line only.

    # GPUs: TorchTitan's own entry point; the trainer is not edited
    torchrun --nproc-per-node 8 examples/torchtitan_debug.py --steps 20 -- --checkpoint.resiliency-interval 5

    # CPU (no GPU): --cpu applies the CPU workarounds of tests/frameworks/torchtitan_cpu.py
    # (test-only patches of TorchTitan and torch, never for production) and a tiny local tokenizer
    # and dataset; FSDP2 over 2 gloo ranks (3+ ranks let SCOUT name a faulty rank exactly)
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_debug.py --cpu --out /tmp/titan-demo --steps 6

Everything after `--` goes to TorchTitan's config parser. The script only runs
`torchtitan.train.main()` with `--module lm_resiliency.integrations.torchtitan --config
llama3_debugmodel`, which selects `ResilientCheckpointManager` (see docs/frameworks.md, TorchTitan).
Kill it mid-run and launch the same command again: it resumes from the last GEMINI capture.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def titan_args(args: argparse.Namespace, extra: list) -> list:
    argv = ["--module", "lm_resiliency.integrations.torchtitan", "--config", "llama3_debugmodel",
            "--training.steps", str(args.steps), "--dump-folder", args.out,
            "--checkpoint.resiliency-interval", str(args.interval), "--checkpoint.resiliency-run-id", args.run_id]
    if args.cpu:
        from tests.frameworks import torchtitan_cpu

        tokenizer, data = torchtitan_cpu.write_assets(os.path.join(args.out, "assets"))
        argv += ["--hf-assets-path", tokenizer, "--dataloader.dataset-path", data,
                 "--training.seq-len", "64", "--training.local-batch-size", "2",
                 "--parallelism.spmd-backend", "partial_dtensor", "--validator.no-enable"]
    return argv + extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="apply the CPU test workarounds (no GPU here)")
    parser.add_argument("--out", default="./outputs/titan-demo", help="TorchTitan dump folder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=2, help="GEMINI capture and SCOUT check interval")
    parser.add_argument("--run-id", default="torchtitan-debug",
                        help="GEMINI run identity; the same on every launch of this run, so a relaunch resumes")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.cpu:
        sys.path.insert(0, ROOT)
        from tests.frameworks import torchtitan_cpu

        torchtitan_cpu.apply()  # before TorchTitan is imported
    argv = titan_args(args, extra)
    from torchtitan.train import main as titan_main

    sys.argv = [sys.argv[0], *argv]
    titan_main()


if __name__ == "__main__":
    main()
