"""GEMINI on 4 CPU ranks under torchrun: train, kill a rank, recover, and prove nothing changed.

This drives the low-level `InMemoryCheckpointManager` exactly as the GEMINI guide's loop does.
Gradients are averaged per parameter in a fixed order so that the comparison with the
baseline is bitwise: DDP's reducer reorders its buckets after its first iteration, and only
`enable_resiliency` and the framework surfaces pin its layout, not this low-level manager (see
docs/frameworks.md, "DDP and bitwise resume").

    python examples/gemini_kill_recover.py            # what `make demo` runs

The launcher (a small supervisor around torchrun) runs the same DDP training twice:
  1. baseline: 12 steps, uninterrupted;
  2. managed: rank 1 SIGKILLs itself in step 7. The other ranks fail in their next
     collective or are stopped by torchrun with SIGTERM; either way GEMINI flushes their
     newest capture and the replica they hold for their peer. The supervisor relaunches the
     job with the same run id; every rank recovers the newest step all ranks can load, and
     training runs on to step 12.
The final parameters and optimizer state of both runs must be bitwise equal.
Periodic disk flush is off: what survives the kill is the peer replica and the SIGTERM flush.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import tempfile

STEPS = 12
KILL_AT = 7
WORLD = 4


def train(out_dir: str, kill: bool) -> None:
    import torch
    import torch.distributed as dist

    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.experimental import InMemoryCheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generation = int(os.environ["DEMO_GENERATION"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = InMemoryCkptConfig(interval=2, replication_jump=2, disk_flush_interval=0,
                                disk_folder=os.path.join(out_dir, "gemini"), timeout_s=60)
    manager = InMemoryCheckpointManager(config)

    start = 0
    recovered = manager.find_latest()
    if recovered is not None:
        state = manager.load()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    if rank == 0:
        where = f"resumed from GEMINI step {start}" if recovered is not None else "fresh start"
        print(f"[gen {generation}] {where}", flush=True)

    for step in range(start + 1, STEPS + 1):
        data = torch.Generator().manual_seed(step * 100 + rank)  # data order depends on step only
        x = torch.randn(16, 32, generator=data)
        loss = model(x).pow(2).mean()
        loss.backward()
        for param in model.parameters():  # data parallel: average gradients, one fixed order
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
        manager.maybe_wait()  # the prior capture is complete before parameters change again
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"[gen {generation}] step {step:2d} loss {loss.item():.6f}", flush=True)
        if kill and generation == 0 and step == KILL_AT and rank == 1:
            print(f"[gen {generation}] rank 1: SIGKILL in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % config.interval == 0:
            manager.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "step": step}, step)

    manager.close()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(out_dir, f"final-rank{rank}.pt"))
    dist.destroy_process_group()


def _fingerprints(path: str) -> dict:
    """sha256 of every tensor in a saved final state, by name."""
    import torch

    state = torch.load(path, weights_only=True)
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    for index, per_param in state["optimizer"]["state"].items():
        tensors.update({f"optimizer.{index}.{k}": v for k, v in per_param.items()})
    return {name: hashlib.sha256(t.numpy().tobytes()).hexdigest() for name, t in sorted(tensors.items())}


def launch(out_dir: str, kill: bool) -> dict:
    """Run torchrun until the job completes (at most one relaunch), keeping one run id."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           os.path.abspath(__file__), "--worker", "--out", out_dir]
    if kill:
        cmd.append("--kill")
    run_id = f"demo-{os.getpid()}-{os.path.basename(out_dir)}"
    for generation in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="ERROR", LM_RESILIENCY_RUN_ID=run_id,
                   DEMO_GENERATION=str(generation))
        with open(os.path.join(out_dir, f"torchrun-gen{generation}.log"), "w") as log:
            done = subprocess.run(cmd, env=env, timeout=600, stdout=subprocess.PIPE, stderr=log, text=True)
        print(done.stdout, end="", flush=True)
        if done.returncode == 0:
            break
        print(f"-- generation {generation} failed (exit {done.returncode}); relaunching with run id "
              f"{run_id} (torchrun log: {log.name})", flush=True)
    else:
        raise RuntimeError(f"training did not complete; see the logs in {out_dir}")
    return {rank: _fingerprints(os.path.join(out_dir, f"final-rank{rank}.pt")) for rank in range(WORLD)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="output directory (default: a temporary directory)")
    args = parser.parse_args()
    if args.worker:
        train(args.out, args.kill)
        return 0
    root = args.out or tempfile.mkdtemp(prefix="gemini-demo-")
    for phase in ("baseline", "managed"):
        os.makedirs(os.path.join(root, phase), exist_ok=True)
    print(f"== baseline: {STEPS} uninterrupted steps on {WORLD} ranks", flush=True)
    baseline = launch(os.path.join(root, "baseline"), kill=False)
    print(f"== managed: rank 1 is killed in step {KILL_AT}; torchrun restarts the group", flush=True)
    managed = launch(os.path.join(root, "managed"), kill=True)
    print("\nrank  tensors  bitwise equal to baseline")
    for rank in range(WORLD):
        differing = [n for n in baseline[rank] if managed[rank].get(n) != baseline[rank][n]]
        print(f"{rank:>4}  {len(baseline[rank]):>7}  {'yes' if not differing else 'NO: ' + ', '.join(differing)}")
    if baseline != managed:
        print("FAIL: recovered training diverged from the baseline", flush=True)
        return 1
    print("\nOK: the run that lost a rank finished bitwise equal to the uninterrupted run.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
