"""What the benchmarks share: rank processes over gloo, per-rank numbers, percentiles, tables.

    results = run_ranks(rank_main, world, opts, work, name="SCOUT benchmark")

`rank_main(rank, world, opts, *args)` runs in `world` spawned processes (one torch thread
each, `init_process_group("gloo")` over a FileStore in `work`, or a TCPStore with `tcp=True`)
and returns a JSON-ready value; `run_ranks` returns them by rank. `opts["timeout"]` bounds
the whole run and every collective wait; a rank that raises, dies or outlives it fails the
run with every rank's error. Progress lines (`log`) show seconds since the parent started.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Sequence, Tuple

T0 = time.monotonic()  # reset in each rank from the parent's, so every line shares one clock


def log(tag: str, msg: str) -> None:
    print(f"[{tag} +{time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def pct(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation (q in 0..100)."""
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def gather(values: List[float], world: int) -> List[List[float]]:
    """Every rank's `values` (same length on every rank), by rank. Collective on the world."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def calibrate_batch(step: Callable[[int], None], world: int, target_s: float, max_batch: int, *, start: int,
                    fraction: float, multiple: int = 1) -> Tuple[int, Dict[int, float]]:
    """(batch, {batch: probed step seconds}): the batch grown from `start` (in multiples of
    `multiple`, at most `max_batch`, at most 8 probes) until the step `step(batch)` takes
    `fraction x target_s`. Each probe is the fastest of 3 steps after a warm-up one, slowest rank
    each, so background load does not shrink the batch and every rank decides from the same
    gathered numbers. Collective on the world."""
    import torch.distributed as dist

    def probe(n: int) -> float:
        step(n)
        times = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            step(n)
            times.append(max(r[0] for r in gather([time.perf_counter() - t0], world)))
        return min(times)

    batch, probes = start, {}
    for _ in range(8):
        probes[batch] = t = probe(batch)
        if t >= fraction * target_s or batch >= max_batch:
            break
        grow = min(4.0, max(1.25, target_s / t))
        batch = min(max_batch, max(batch + multiple, int(round(batch * grow / multiple)) * multiple))
    return batch, probes


def format_table(rows: List[dict], columns: Sequence[str] = (), heads: Sequence[str] = ()) -> str:
    """`rows` (dicts) as a text table of `columns` (default: every key of the first row), headed
    by `heads` (default: the column names)."""
    cols = list(columns) or list(rows[0].keys())
    heads = list(heads) or cols
    widths = [max(len(h), *(len(str(r[c])) for r in rows)) for c, h in zip(cols, heads)]
    line = lambda vals: " | ".join(str(v).ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(heads), "-+-".join("-" * w for w in widths)] + [line([r[c] for c in cols]) for r in rows])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, args: tuple, rank: int, world: int, opts: dict, init_method: str, result_path: str) -> None:
    global T0
    T0 = opts["t0"]
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=opts["timeout"]))
        payload = {"ok": True, "result": fn(rank, world, opts, *args)}
    except BaseException:  # noqa: BLE001 - reported by the parent
        payload = {"ok": False, "error": traceback.format_exc()}
        code = 1
    try:
        with open(result_path + ".tmp", "w") as f:
            json.dump(payload, f)
        os.replace(result_path + ".tmp", result_path)
    finally:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)  # skip interpreter teardown: gloo threads can abort a normal exit


def run_ranks(fn: Callable, world: int, opts: dict, work: str, *args: Any, name: str = "benchmark",
              tcp: bool = False) -> List[Any]:
    """Run `fn(rank, world, opts, *args)` on `world` gloo processes; their results by rank."""
    opts = dict(opts, t0=T0)
    os.environ["OMP_NUM_THREADS"] = "1"
    init_method = f"tcp://127.0.0.1:{_free_port()}" if tcp else f"file://{os.path.join(work, 'store')}"
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(world):
        p = ctx.Process(target=_child, args=(fn, args, rank, world, opts, init_method,
                                             os.path.join(work, f"result{rank}.json")), daemon=True)
        p.start()
        procs.append(p)
    deadline = time.monotonic() + opts["timeout"]
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    results, errors = [], []
    for rank, p in enumerate(procs):
        path = os.path.join(work, f"result{rank}.json")
        if not os.path.exists(path):
            errors.append(f"rank {rank}: no result (exit code {p.exitcode})")
            results.append(None)
            continue
        with open(path) as f:
            payload = json.load(f)
        os.unlink(path)
        if not payload["ok"]:
            errors.append(f"rank {rank} raised:\n{payload['error']}")
        results.append(payload.get("result"))
    if hung:
        errors.insert(0, f"ranks {hung} did not finish within {opts['timeout']}s (killed)")
    if errors:
        raise RuntimeError(f"{name} failed:\n" + "\n".join(errors))
    return results
