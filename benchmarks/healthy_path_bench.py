"""Healthy-path overhead of `enable_resiliency` on DDP training: throughput with and without it.

    python -m benchmarks.healthy_path_bench [--rounds 6] [--steps 20] [--out benchmarks/results/healthy_path.json]

`--ranks` real processes joined by gloo (FileStore) train an MLP of `--layers`
Linear(`--width`, `--width`) layers with DDP and Adam, one thread each. Four configurations
live side by side in the same processes, each with its own model and optimizer (same
initial weights): the unchanged loop (baseline), the same loop with only DDP's bucket layout
pinned as the Lightning callback and Accelerate plugin pin it (lm_resiliency/_torch_compat.py; no
session; `enable_resiliency` leaves DDP's layout as it is), the loop under
`enable_resiliency` with GEMINI at `--interval` (default 10) and the same at interval 1. After a
warm-up (which also
fills GEMINI's host slots), the configurations run in interleaved rounds of `--steps` steps,
rotating the order each round, so background load hits all of them alike. A round ends when
the configuration's background work (capture, replication, flush) is drained; that tail is
counted in its time.

Reported per configuration: throughput (steps / summed round wall time, slowest rank), p50 and
p95 step time (slowest rank per step) and throughput loss against the baseline. Blocking time
inside the session's hooks (`_before_forward` + `_before_optimizer_step` +
`_after_optimizer_step`) is measured by wrapping those methods in the benchmark processes;
library files are not modified. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

from benchmarks._ranks import calibrate_batch, format_table, gather, pct, run_ranks
from benchmarks._ranks import log as _log

MIB = 1024 * 1024

# Blocking time inside the session hooks, accumulated by the wrappers below (one model trains at
# a time in a rank process, so one accumulator per hook name suffices).
_HOOK_NAMES = ("_before_forward", "_before_optimizer_step", "_after_optimizer_step")
_HOOK_S: Dict[str, float] = {name: 0.0 for name in _HOOK_NAMES}


def log(msg: str) -> None:
    _log("healthy-bench", msg)


def install_hook_timers() -> None:
    """Wrap the session's step hooks (class attributes, so sessions built afterwards bind the
    wrappers) to accumulate the time the training thread spends inside them."""
    from lm_resiliency.session import ResiliencySession

    for name in _HOOK_NAMES:
        original = getattr(ResiliencySession, name)
        if getattr(original, "_healthy_bench", False):
            continue

        def timed(self, _original=original, _name=name):
            t0 = time.perf_counter()
            try:
                return _original(self)
            finally:
                _HOOK_S[_name] += time.perf_counter() - t0

        timed._healthy_bench = True  # type: ignore[attr-defined]
        setattr(ResiliencySession, name, timed)


# Wall time of GEMINI's background jobs (capture copy, replication exchange, disk flush) on the
# manager's worker threads, accumulated by wrappers installed the same way.
_BACKGROUND_NAMES = {"_complete_capture": "copy", "_replicate": "replication", "_flush": "flush"}
_BACKGROUND_S: Dict[str, float] = {label: 0.0 for label in _BACKGROUND_NAMES.values()}
_BACKGROUND_LOCK = threading.Lock()


def install_background_timers() -> None:
    from lm_resiliency.gemini.manager import InMemoryCheckpointManager

    for name, label in _BACKGROUND_NAMES.items():
        original = getattr(InMemoryCheckpointManager, name, None)
        if original is None or getattr(original, "_healthy_bench", False):
            continue

        def timed(self, *args, _original=original, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                with _BACKGROUND_LOCK:
                    _BACKGROUND_S[_label] += time.perf_counter() - t0

        timed._healthy_bench = True  # type: ignore[attr-defined]
        setattr(InMemoryCheckpointManager, name, timed)


def take_background_time() -> Dict[str, float]:
    with _BACKGROUND_LOCK:
        out = dict(_BACKGROUND_S)
        for label in _BACKGROUND_S:
            _BACKGROUND_S[label] = 0.0
    return out


def take_hook_time() -> Dict[str, float]:
    out = dict(_HOOK_S)
    for name in _HOOK_NAMES:
        _HOOK_S[name] = 0.0
    return out


# ----------------------------------------------------------------------------- rank side


class Config:
    """One configuration under test: its own DDP model, optimizer and (maybe) session."""

    def __init__(self, name: str, interval: Optional[int], pin: bool = False) -> None:
        self.name = name
        self.interval = interval
        self.pin = pin
        self.model = None
        self.optimizer = None
        self.session = None
        self.rounds: List[dict] = []


def rank_main(rank: int, world: int, opts: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import InMemoryCkptConfig, enable_resiliency
    from lm_resiliency._torch_compat import bucket_layout, pin_bucket_layout

    say = log if rank == 0 else (lambda m: None)
    install_hook_timers()
    install_background_timers()
    width, layers = opts["width"], opts["layers"]

    def build(seed: int = 0):
        torch.manual_seed(seed)
        mods: List[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(width, width), nn.ReLU()]
        model = DDP(nn.Sequential(*mods))
        return model, torch.optim.Adam(model.parameters(), lr=1e-5)

    gen = torch.Generator().manual_seed(100 + rank)
    batches: Dict[int, tuple] = {}

    def batch(n: int) -> tuple:
        if n not in batches:
            batches[n] = (torch.randn(n, width, generator=gen), torch.randn(n, width, generator=gen))
        return batches[n]

    def step(model, optimizer, x, y) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    configs = [Config("baseline", None), Config("DDP layout pinned", None, pin=True),
               Config(f"GEMINI interval {opts['interval']}", opts["interval"]), Config("GEMINI interval 1", 1)]
    for cfg in configs:
        cfg.model, cfg.optimizer = build()
        if cfg.pin and not pin_bucket_layout(cfg.model):  # collective, before any step
            raise RuntimeError("the DDP bucket layout could not be pinned")

    # --- batch size: grow it until the baseline step reaches --step-ms. Each probe is the fastest of
    # a few steps (slowest rank each), so background load does not shrink the batch; every rank
    # decides from the same gathered numbers, so all agree.
    calibration: Dict[str, Any] = {}
    base = configs[0]
    target = opts["step_ms"] / 1000.0
    if opts["batch"] > 0:
        batch_size = opts["batch"]
    else:
        batch_size, probes = calibrate_batch(lambda n: step(base.model, base.optimizer, *batch(n)), world, target,
                                             opts["max_batch"], start=8, fraction=0.85, multiple=8)
        calibration = {"probe_step_s": {str(k): v for k, v in probes.items()}, "target_s": target}
        say("calibration: " + ", ".join(f"batch {k}: {v * 1e3:.0f} ms" for k, v in probes.items())
            + f" -> batch {batch_size} for ~{opts['step_ms']:.0f} ms")
    batches.clear()
    x, y = batch(batch_size)

    state_bytes = sum(p.numel() * p.element_size() for p in base.model.parameters()) * 3  # + Adam m, v

    # --- sessions (collective: every rank enables them in the same order)
    for cfg in configs:
        if cfg.interval is None:
            continue
        ckpt = {"disk_folder": os.path.join(opts["work_dir"], f"ckpt-i{cfg.interval}"),
                "run_id": f"healthy-bench-{opts['token']}-i{cfg.interval}", "replication_jump": 1,
                "disk_flush_interval": opts["disk_flush_interval"], "timeout_s": float(opts["timeout"])}
        if opts["host_memory"]:
            ckpt["host_memory"] = opts["host_memory"]
        t0 = time.perf_counter()
        cfg.session = enable_resiliency(cfg.model, cfg.optimizer, interval=cfg.interval,
                                        checkpoint=InMemoryCkptConfig(**ckpt), enable_detection=False)
        cfg.enable_s = time.perf_counter() - t0
        say(f"{cfg.name}: enable_resiliency took {cfg.enable_s:.2f} s "
            f"(host memory: {cfg.session.manager.host_memory().mode})")

    def drain(cfg: Config) -> None:
        if cfg.session is not None and cfg.session.manager is not None:
            cfg.session.manager._drain()  # capture, replication and flush workers idle

    # --- warm-up: every configuration; GEMINI ones until two captures filled all host slots
    for cfg in configs:
        n = 5 if cfg.interval is None else max(5, 2 * cfg.interval + 2)
        t0 = time.perf_counter()
        for _ in range(n):
            step(cfg.model, cfg.optimizer, x, y)
        drain(cfg)
        take_hook_time()
        take_background_time()
        say(f"warm-up {cfg.name}: {n} steps in {time.perf_counter() - t0:.1f} s")

    # --- interleaved rounds, order rotated each round
    steps = opts["steps"]
    for rnd in range(opts["rounds"]):
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        for cfg in order:
            step_s, hook_s, starts = [], [], []
            hook_parts = {name: 0.0 for name in _HOOK_NAMES}
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                # this step's forward starts a capture (the previous step ended on an interval)
                starts.append(cfg.session is not None and cfg.session._pending is not None)
                s0 = time.perf_counter()
                step(cfg.model, cfg.optimizer, x, y)
                step_s.append(time.perf_counter() - s0)
                parts = take_hook_time()
                hook_s.append(sum(parts.values()))
                for name, v in parts.items():
                    hook_parts[name] += v
            t_loop = time.perf_counter()
            drain(cfg)
            t_end = time.perf_counter()
            background = take_background_time()
            labels = list(_BACKGROUND_S)
            g = gather([t_end - t0, t_end - t_loop] + step_s + hook_s + [hook_parts[n] for n in _HOOK_NAMES]
                       + [background[k] for k in labels], world)
            nb = 2 + 2 * steps + len(_HOOK_NAMES)
            rec = {
                "round": rnd,
                "wall_s": max(r[0] for r in g),
                "tail_s": max(r[1] for r in g),
                "step_s": [max(r[2 + i] for r in g) for i in range(steps)],  # slowest rank per step
                "hook_s": [max(r[2 + steps + i] for r in g) for i in range(steps)],
                "capture_starts": starts,
                "hook_parts_s": {n: max(r[2 + 2 * steps + j] for r in g) for j, n in enumerate(_HOOK_NAMES)},
                "background_s": {k: max(r[nb + j] for r in g) for j, k in enumerate(labels)},
                "per_rank_wall_s": [r[0] for r in g],
            }
            cfg.rounds.append(rec)
            say(f"round {rnd + 1}/{opts['rounds']} {cfg.name}: {steps / rec['wall_s']:.2f} steps/s, "
                f"p50 {statistics.median(rec['step_s']) * 1e3:.0f} ms, tail {rec['tail_s'] * 1e3:.0f} ms, "
                f"hooks {sum(rec['hook_s']) * 1e3:.0f} ms")

    out: Dict[str, Any] = {"batch": batch_size, "calibration": calibration, "state_bytes_per_rank": state_bytes,
                           "configs": []}
    for cfg in configs:
        entry = {"name": cfg.name, "interval": cfg.interval, "rounds": cfg.rounds,
                 "ddp_buckets": [len(b) for b in bucket_layout(cfg.model)]}
        if cfg.session is not None:
            t0 = time.perf_counter()
            entry["host_memory"] = cfg.session.manager.host_memory().mode
            entry["latest_step"] = cfg.session.manager.latest_step
            cfg.session.close()
            entry["close_s"] = time.perf_counter() - t0
            entry["enable_s"] = cfg.enable_s
        out["configs"].append(entry)
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- report


def summarize(entry: dict) -> dict:
    rounds = entry["rounds"]
    steps = sum(len(r["step_s"]) for r in rounds)
    wall = sum(r["wall_s"] for r in rounds)
    step_s = [s for r in rounds for s in r["step_s"]]
    hook_s = [s for r in rounds for s in r["hook_s"]]
    starts = [c for r in rounds for c in r["capture_starts"]]
    at_capture = [t for t, c in zip(step_s, starts) if c]
    other = [t for t, c in zip(step_s, starts) if not c]
    return {
        "steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
        "per_round_steps_per_s": [len(r["step_s"]) / r["wall_s"] for r in rounds],
        "step_p50_s": pct(step_s, 50), "step_p95_s": pct(step_s, 95), "step_mean_s": statistics.mean(step_s),
        "tail_s_per_round": [r["tail_s"] for r in rounds],
        "hook_mean_per_step_s": statistics.mean(hook_s),
        "hook_max_step_s": max(hook_s),
        "captures": len(at_capture),
        "capture_step_mean_s": statistics.mean(at_capture) if at_capture else None,
        "other_step_mean_s": statistics.mean(other) if other else None,
        "hook_mean_per_capture_s": sum(hook_s) / len(at_capture) if at_capture else None,
        "hook_parts_total_s": {k: sum(r["hook_parts_s"][k] for r in rounds) for k in _HOOK_NAMES},
        "background_total_s": {k: sum(r["background_s"][k] for r in rounds) for k in _BACKGROUND_S},
    }


def build_rows(summaries: List[dict], interval: int) -> List[dict]:
    base = summaries[0]
    rows = []
    for s in summaries:
        loss = (1.0 - s["steps_per_s"] / base["steps_per_s"]) * 100.0
        per_round = [(1.0 - c / b) * 100.0
                     for c, b in zip(s["per_round_steps_per_s"], base["per_round_steps_per_s"])]
        s["throughput_loss_pct"] = loss
        s["per_round_throughput_loss_pct"] = per_round
        s["median_round_throughput_loss_pct"] = statistics.median(per_round)
        is_base = s is base
        target = "< 1% loss" if s["interval"] == interval and interval != 1 else "-"
        ok = None if target == "-" else loss < 1.0
        s["result"] = "-" if ok is None else ("PASS" if ok else "MISS")
        hook = "-" if s["interval"] is None else (f"{s['hook_mean_per_step_s'] * 1e3:.2f} ms "
                                    f"({s['hook_mean_per_step_s'] / base['step_p50_s'] * 100:.2f}%)")
        rows.append({
            "config": s["name"],
            "steps/s": f"{s['steps_per_s']:.3f}",
            "p50 step": f"{s['step_p50_s'] * 1e3:.1f} ms",
            "p95 step": f"{s['step_p95_s'] * 1e3:.1f} ms",
            "throughput loss": "-" if is_base else f"{loss:+.2f}%",
            "median of rounds": "-" if is_base else f"{statistics.median(per_round):+.2f}%",
            "hook blocking/step": hook,
            "target": target,
            "result": s["result"],
        })
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="gloo processes on this machine (>= 2)")
    p.add_argument("--layers", type=int, default=3, help="Linear(width, width) layers of the MLP")
    p.add_argument("--width", type=int, default=2048, help="MLP width")
    p.add_argument("--batch", type=int, default=0, help="per-rank batch size (0: calibrate to --step-ms)")
    p.add_argument("--step-ms", type=float, default=150.0, help="baseline step time the batch is sized for")
    p.add_argument("--max-batch", type=int, default=512, help="largest batch the calibration may pick")
    p.add_argument("--interval", type=int, default=10, help="GEMINI interval of the main configuration")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=20, help="training steps per configuration per round")
    p.add_argument("--disk-flush-interval", type=int, default=0,
                   help="InMemoryCkptConfig.disk_flush_interval (0: no periodic node-local flush)")
    p.add_argument("--host-memory", choices=("shared", "heap"), default=None,
                   help="InMemoryCkptConfig.host_memory (default: the library default)")
    p.add_argument("--out", default="benchmarks/results/healthy_path.json", help="JSON results path")
    p.add_argument("--timeout", type=float, default=900.0, help="limit for the whole run and every wait (s)")
    p.add_argument("--tmp", default=None, help="parent of the temporary working directory")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error("--ranks must be >= 2 (peer replication needs a peer)")
    if min(args.layers, args.width, args.interval, args.rounds, args.steps) < 1 or args.batch < 0:
        p.error("--layers, --width, --interval, --rounds and --steps must be positive, --batch >= 0")

    work = tempfile.mkdtemp(prefix="healthy-bench-", dir=args.tmp)
    opts = {"layers": args.layers, "width": args.width, "batch": args.batch, "step_ms": args.step_ms,
            "max_batch": max(8, args.max_batch),
            "interval": args.interval, "rounds": args.rounds, "steps": args.steps,
            "disk_flush_interval": args.disk_flush_interval, "host_memory": args.host_memory,
            "timeout": args.timeout, "work_dir": work, "token": uuid.uuid4().hex[:8]}
    load_start = list(os.getloadavg())
    log(f"{args.ranks} ranks, MLP {args.layers} x Linear({args.width}, {args.width}), {args.rounds} rounds x "
        f"{args.steps} steps, working in {work} (load average {load_start[0]:.2f})")
    try:
        results = run_ranks(rank_main, args.ranks, opts, work, name="healthy-path benchmark")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_end = list(os.getloadavg())
    r0 = results[0]
    summaries = []
    for entry in r0["configs"]:
        s = summarize(entry)
        s.update({"name": entry["name"], "interval": entry["interval"], "ddp_buckets": entry["ddp_buckets"]})
        summaries.append(s)
    rows = build_rows(summaries, args.interval)
    import torch

    base = summaries[0]
    result = {
        "benchmark": "healthy_path",
        "config": {"ranks": args.ranks, "layers": args.layers, "width": args.width, "batch": r0["batch"],
                   "step_ms_target": args.step_ms, "interval": args.interval, "rounds": args.rounds,
                   "steps_per_round": args.steps, "disk_flush_interval": args.disk_flush_interval,
                   "host_memory": [e.get("host_memory") for e in r0["configs"]],
                   "replication_jump": 1, "optimizer": "Adam", "state_bytes_per_rank": r0["state_bytes_per_rank"]},
        "environment": {"loadavg_start": load_start, "loadavg_end": load_end, "torch": torch.__version__,
                        "python": platform.python_version(), "platform": platform.platform(),
                        "cpus": os.cpu_count(), "device": "cpu", "backend": "gloo", "threads_per_rank": 1},
        "calibration": r0["calibration"],
        "rows": rows,
        "summaries": summaries,
        "per_config": r0["configs"],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    spread = base["per_round_steps_per_s"]
    noise = (max(spread) - min(spread)) / statistics.mean(spread) * 100.0
    print(f"Healthy-path overhead: {args.ranks} ranks (gloo, 1 thread each), DDP MLP {args.layers} x "
          f"Linear({args.width}, {args.width}) + Adam, batch {r0['batch']}/rank, "
          f"{r0['state_bytes_per_rank'] / MIB:.0f} MiB state/rank, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    print(f"{args.rounds} interleaved rounds x {args.steps} steps per config (order rotated), replication_jump=1, "
          f"disk_flush_interval={args.disk_flush_interval}, host memory "
          f"{'/'.join(str(e.get('host_memory')) for e in r0['configs'][2:])}; load average "
          f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
    print(f"baseline step time: p50 {base['step_p50_s'] * 1e3:.1f} ms, p95 {base['step_p95_s'] * 1e3:.1f} ms "
          f"(slowest rank per step); baseline round-to-round throughput spread {noise:.1f}%")
    print(format_table(rows))
    pinned = summaries[1]
    print(f"DDP layout pin alone: throughput {pinned['throughput_loss_pct']:+.2f}% against the baseline (median of "
          f"rounds {pinned['median_round_throughput_loss_pct']:+.2f}%); buckets (parameters each, in all-reduce "
          f"order): baseline after its rebuild {base['ddp_buckets']}, pinned {pinned['ddp_buckets']}")
    for s in summaries[2:]:
        if s["captures"]:
            parts = s["hook_parts_total_s"]
            other = (f" vs {s['other_step_mean_s'] * 1e3:.1f} ms otherwise" if s["other_step_mean_s"] is not None
                     else " (every step starts one)")
            print(f"{s['name']}: {s['captures']} captures; mean step {s['capture_step_mean_s'] * 1e3:.1f} ms when "
                  f"it starts a capture{other}; hook blocking "
                  f"{s['hook_mean_per_capture_s'] * 1e3:.1f} ms per capture interval (before_forward/save "
                  f"{parts['_before_forward'] * 1e3:.0f} ms, before_optimizer_step/maybe_wait "
                  f"{parts['_before_optimizer_step'] * 1e3:.0f} ms, after_optimizer_step "
                  f"{parts['_after_optimizer_step'] * 1e3:.0f} ms in total)")
            bg = s["background_total_s"]
            busy = " + ".join(f"{k} {v / s['captures'] * 1e3:.0f} ms" for k, v in bg.items() if v > 0)
            print(f"  background work per capture (worker-thread wall, slowest rank): {busy or 'none'}, "
                  f"i.e. {sum(bg.values()) / s['wall_s'] * 100:.0f}% of the configuration's wall time")
    print("throughput = steps / summed round wall time (slowest rank), each round ending when that config's "
          "capture/replication work is drained; loss = 1 - ours/baseline; hook blocking = training-thread "
          "time in the session's step hooks, mean per step (% of baseline p50 step).")
    print(f"CPU caveat: {os.cpu_count()} cores run {args.ranks} single-threaded ranks, so GEMINI's background "
          "capture copy and gloo replication threads take cycles from training compute (on GPUs the copy "
          "is a DMA on a side stream and replication uses idle host cores, overlapping compute). A "
          "throughput loss within the baseline's round-to-round spread is noise, not overhead.")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
