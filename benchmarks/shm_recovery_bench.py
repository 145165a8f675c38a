"""Recovery after a worker crash: a predecessor's shared-memory slots vs node-local disk vs torch.load.

    python -m benchmarks.shm_recovery_bench [--mib 256] [--ranks 2] [--repeats 3]
                                            [--out benchmarks/results/shm_recovery.json]

1. ``capture``: `--ranks` processes joined by gloo build a ~`--mib` MiB model+optimizer state
   per rank, capture it with GEMINI (shared-memory host slots, peer replica, node-local flush
   of the same step) and also ``torch.save`` it (fsynced); then every rank SIGKILLs itself.
2. Every recovery below runs in fresh processes, `--repeats` times; a row is the median over
   repetitions of the slowest rank:
   - ``shm``: `InMemoryCheckpointManager` construction (adopts the dead predecessor's slots),
     ``find_latest()`` and ``load()``; nothing is read from disk.
   - ``disk (cold|warm)``: the same calls with ``host_memory="heap"`` (no adoption), so the
     state comes from the node-local shards; "cold" drops their page cache first
     (``fsync`` + ``POSIX_FADV_DONTNEED``, best effort).
   - ``torch.load (cold|warm)``: ``torch.load(weights_only=True)`` of the same state.
   Every recovered state is checked against the captured one (CRC-32 of every tensor).

Columns: "load" is the state in the caller's hands (``find_latest()`` + ``load()``, or
``torch.load``); "load+apply" adds copying it into the live model/optimizer tensors, as
``load_state_dict`` does (a recovery from shared memory hands out a copy-on-write mapping,
so its one real copy happens here); "end-to-end" adds GEMINI manager construction (gloo
group, run/topology agreement, adoption of the predecessor's slots). ``torch.load`` has no
construction step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List

from benchmarks._state import drop_page_cache, fingerprint, leaves, make_state, nbytes_of

MIB = 1024 * 1024
RUN_ID = "shm-recovery-bench"
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[shm-bench +{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- state


def apply(dst: Any, src: Any) -> None:
    """Copy a recovered state into the live tensors, as load_state_dict does."""
    import torch

    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k, v in dst.items():
            apply(v, src[k])
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            apply(a, b)


def read_all(root: str) -> None:
    """Warm the page cache for every file under root."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while f.read(16 * MIB):
                    pass


# ------------------------------------------------------------------------------ phases


def _config(args: dict, **kw):
    from lm_resiliency import InMemoryCkptConfig

    base = dict(interval=1, replication_jump=1, disk_flush_interval=1, disk_folder=args["disk"],
                shared_memory_dir=args["shm"], run_id=RUN_ID, timeout_s=600, pin_memory=False)
    base.update(kw)
    return InMemoryCkptConfig(**base)


def phase_capture(rank: int, world: int, args: dict) -> dict:
    import torch

    from lm_resiliency.experimental import InMemoryCheckpointManager

    state = make_state(rank, args["bytes"])
    manager = InMemoryCheckpointManager(_config(args), install_signal_handlers=False)
    start = time.perf_counter()
    manager.save(state, 1)
    manager._drain()  # own slot READY, replica held by the peer, node-local shards published
    capture_s = time.perf_counter() - start
    path = os.path.join(args["work"], f"torch-rank{rank}.pt")
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return {"fingerprint": fingerprint(state), "bytes": nbytes_of(leaves(state)), "capture_s": capture_s,
            "host_memory": manager.host_memory().total_bytes, "kill": True}


def phase_gemini(rank: int, world: int, args: dict, host_memory: str) -> dict:
    import torch.distributed as dist

    from lm_resiliency.experimental import InMemoryCheckpointManager

    live = make_state(rank, args["bytes"], fill=False)
    dist.barrier()
    t0 = time.perf_counter()
    manager = InMemoryCheckpointManager(_config(args, host_memory=host_memory), install_signal_handlers=False)
    t1 = time.perf_counter()
    step = manager.find_latest()
    state = manager.load()
    t2 = time.perf_counter()
    apply(live, state)
    t3 = time.perf_counter()
    sources = dict(manager.recovery_sources)
    del state
    manager.close(keep_shared=True)  # the next repetition adopts the same slots again
    return {"step": step, "sources": sources, "load_s": t2 - t1, "load_apply_s": t3 - t1,
            "end_to_end_s": t3 - t0, "fingerprint": fingerprint(live)}


def phase_torch_load(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    live = make_state(rank, args["bytes"], fill=False)
    dist.barrier()
    t0 = time.perf_counter()
    state = torch.load(os.path.join(args["work"], f"torch-rank{rank}.pt"), weights_only=True)
    t1 = time.perf_counter()
    apply(live, state)
    t2 = time.perf_counter()
    return {"load_s": t1 - t0, "load_apply_s": t2 - t0, "end_to_end_s": t2 - t0, "fingerprint": fingerprint(live)}


def _child(phase: str, rank: int, world: int, args: dict, extra: tuple, init_file: str, out: str) -> None:
    code = 0
    kill = False
    try:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world)})
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        fn = {"capture": phase_capture, "gemini": phase_gemini, "torch_load": phase_torch_load}[phase]
        result = {"ok": fn(rank, world, args, *extra)}
        kill = bool(result["ok"].pop("kill", False))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        result = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        code = 1
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close(), no atexit, no flush
    os._exit(code)


def run_phase(phase: str, world: int, args: dict, *extra: Any) -> List[dict]:
    ctx = mp.get_context("forkserver")
    with tempfile.TemporaryDirectory(prefix="shm-bench-ranks-") as tmp:
        procs = []
        for rank in range(world):
            out = os.path.join(tmp, f"result{rank}.json")
            p = ctx.Process(target=_child, args=(phase, rank, world, args, extra, os.path.join(tmp, "store"), out))
            p.start()
            procs.append((p, out))
        results = []
        for p, out in procs:
            p.join(900)
            if p.is_alive():
                p.kill()
                raise RuntimeError(f"{phase}: a rank did not finish within 900 s")
            with open(out) as f:
                result = json.load(f)
            if "error" in result:
                raise RuntimeError(f"{phase}: rank failed:\n{result['error']}")
            results.append(result["ok"])
    return results


# ------------------------------------------------------------------------------- main


def main(argv: List[str] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="state size per rank in MiB (default 256)")
    parser.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per method (default 3)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "shm_recovery.json"))
    parser.add_argument("--work-dir", default=None, help="node-local disk folder (default: a new temp dir)")
    parser.add_argument("--shm-dir", default=None,
                        help="shared-memory directory (default: /dev/shm/lm-resiliency-<uid>-bench-<pid>)")
    opts = parser.parse_args(argv)
    if opts.ranks < 2 or opts.mib < 1 or opts.repeats < 1:
        parser.error("--ranks must be >= 2, --mib and --repeats >= 1")

    mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
    work = opts.work_dir or tempfile.mkdtemp(prefix="shm-recovery-bench-")
    os.makedirs(work, exist_ok=True)
    shm_dir = opts.shm_dir or f"/dev/shm/lm-resiliency-{os.geteuid()}-bench-{os.getpid()}"
    args = {"bytes": opts.mib * MIB, "work": work, "disk": os.path.join(work, "disk"), "shm": shm_dir}
    try:
        log(f"capture: {opts.ranks} ranks x {opts.mib} MiB, then SIGKILL every rank")
        captured = run_phase("capture", opts.ranks, args)
        expected = [c["fingerprint"] for c in captured]
        per_rank = max(c["bytes"] for c in captured)

        samples: Dict[str, List[dict]] = {k: [] for k in
                                          ("shm", "disk (cold)", "disk (warm)", "torch.load (cold)",
                                           "torch.load (warm)")}
        for rep in range(opts.repeats):
            log(f"repetition {rep + 1}/{opts.repeats}")
            samples["shm"].append(_checked("shm", run_phase("gemini", opts.ranks, args, "shared"),
                                           expected, "shared-memory"))
            drop_page_cache(args["disk"])
            samples["disk (cold)"].append(_checked("disk (cold)", run_phase("gemini", opts.ranks, args, "heap"),
                                                   expected, "disk"))
            read_all(args["disk"])
            samples["disk (warm)"].append(_checked("disk (warm)", run_phase("gemini", opts.ranks, args, "heap"),
                                                   expected, "disk"))
            drop_page_cache(work)
            samples["torch.load (cold)"].append(_checked("torch.load (cold)",
                                                         run_phase("torch_load", opts.ranks, args), expected))
            read_all(work)
            samples["torch.load (warm)"].append(_checked("torch.load (warm)",
                                                         run_phase("torch_load", opts.ranks, args), expected))
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        if opts.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

    rows = []
    for method, reps in samples.items():
        row = {"method": method}
        for key in ("load_s", "load_apply_s", "end_to_end_s"):
            row[key] = statistics.median(r[key] for r in reps)
            row[f"samples_{key}"] = [r[key] for r in reps]
        row["gb_per_s_load_apply"] = per_rank / row["load_apply_s"] / 1e9
        rows.append(row)
    shm_row = rows[0]
    for row in rows:
        row["x_vs_shm_load_apply"] = row["load_apply_s"] / shm_row["load_apply_s"]
        row["x_vs_shm_end_to_end"] = row["end_to_end_s"] / shm_row["end_to_end_s"]

    result = {
        "benchmark": "shm_recovery",
        "ranks": opts.ranks, "state_bytes_per_rank": per_rank, "repeats": opts.repeats,
        "capture_s": max(c["capture_s"] for c in captured),
        "host_memory_bytes_per_rank": max(c["host_memory"] for c in captured),
        "rows": rows,
        "environment": {"python": platform.python_version(), "torch": _torch_version(),
                        "cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average_1m": os.getloadavg()[0],
        "notes": "median over repetitions of the slowest rank; load = state in hand (GEMINI: "
                 "find_latest+load), load_apply = load + copy into the live model/optimizer "
                 "tensors (as load_state_dict), end_to_end = load_apply + manager construction "
                 "(gloo group, run/topology agreement, adoption); cold = page cache dropped with "
                 "POSIX_FADV_DONTNEED (best effort)",
    }
    print(_table(result))
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=2)
    log(f"wrote {opts.out}")
    return result


def _checked(method: str, results: List[dict], expected: List[list], source: str = None) -> dict:
    for rank, r in enumerate(results):
        if r["fingerprint"] != expected[rank]:
            raise AssertionError(f"{method}: rank {rank} recovered a state that differs from the capture")
        if source is not None and (r["step"] != 1 or set(r["sources"].values()) != {source}):
            raise AssertionError(f"{method}: rank {rank} recovered step {r['step']} from {r['sources']}, "
                                 f"expected step 1 from {source}")
    return {key: max(r[key] for r in results) for key in ("load_s", "load_apply_s", "end_to_end_s")}


def _torch_version() -> str:
    import torch

    return torch.__version__


def _table(result: dict) -> str:
    mib = result["state_bytes_per_rank"] / MIB
    lines = [f"GEMINI recovery after SIGKILL: {result['ranks']} ranks x {mib:.0f} MiB/rank, "
             f"median of {result['repeats']} (slowest rank), load average {result['load_average_1m']:.1f}",
             f"{'method':<19}{'load s':>9}{'load+apply s':>14}{'x shm':>7}{'GB/s':>7}"
             f"{'end-to-end s':>14}{'x shm':>7}",
             "-" * 77]
    for row in result["rows"]:
        lines.append(f"{row['method']:<19}{row['load_s']:>9.3f}{row['load_apply_s']:>14.3f}"
                     f"{row['x_vs_shm_load_apply']:>7.1f}{row['gb_per_s_load_apply']:>7.2f}"
                     f"{row['end_to_end_s']:>14.3f}{row['x_vs_shm_end_to_end']:>7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
