"""One training rank: a plain PyTorch DistributedDataParallel loop, lm-resiliency attached with
one call. lm-resiliency pins DDP's gradient-bucket layout when it attaches, so every generation
(first or relaunched) sums gradients in the same order and the run ends bitwise equal to the
baseline (docs/frameworks.md, "DDP and bitwise resume").

What the rank tells the supervisor goes to `events/rank<r>.jsonl` (one JSON object per line):
  resumed      what `enable_resiliency` recovered (step, source per rank)
  step         loss and wall time of each completed optimizer step
  fault        each SCOUT fault report (replay verdicts and the out-of-band monitor's reports)
  decision     each recovery decision SCOUT handed to orchestration
  rejected     a GEMINI shard refused at load (for example a CRC mismatch)
  stop         the ranks stopped on purpose (SDC: restart from RECOVERY_VERIFIED state)
  finished     the run reached its last step; the final state is in final/rank<r>.pt
The out-of-band hang report is written from SCOUT's monitor thread while the training thread is
blocked: that line is the "marker" the supervisor polls before it kills the generation.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict

from . import scenario

RESTART_EXIT_CODE = 75   # "stopped on purpose, relaunch me" (EX_TEMPFAIL)
SDC_KINDS = ("sdc", "sdc_peer_group", "sdc_inconclusive")


class EventLog:
    """Append-only JSON lines, one `write` per line (the supervisor may read concurrently)."""

    def __init__(self, path: str, rank: int, generation: int) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self._rank, self._generation = rank, generation

    def write(self, event: str, **fields: Any) -> None:
        doc = {"event": event, "rank": self._rank, "gen": self._generation, "t": time.time(), **fields}
        line = (json.dumps(doc, default=repr, allow_nan=False) + "\n").encode("utf-8")
        with self._lock:
            os.write(self._fd, line)


class _RejectedShards(logging.Handler):
    """GEMINI reports a shard it refuses at load only as a log warning
    ("GEMINI: skipping step %d for rank %d: %s"); turn it into an event."""

    def __init__(self, events: EventLog) -> None:
        super().__init__(logging.WARNING)
        self._events = events

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("GEMINI: skipping step") and isinstance(record.args, tuple) \
                and len(record.args) == 3:
            step, owner, reason = record.args
            self._events.write("rejected", step=int(step), owner=int(owner), reason=str(reason))


def child_main(options: Dict[str, Any], log_path: str) -> None:
    """Entry point of a rank process (forked by the supervisor's fork server, which has torch and
    lm_resiliency imported already): stdout/stderr go to `log_path`, then `run`."""
    import argparse

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ["OMP_NUM_THREADS"] = "1"
    run(argparse.Namespace(**options))


def run(args) -> int:
    rank, gen = args.rank, args.gen
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s gen{gen} rank{rank} %(name)s %(levelname)s: %(message)s")
    events = EventLog(os.path.join(scenario.paths(args.root, args.label)["events"], f"rank{rank}.jsonl"), rank, gen)
    logging.getLogger("lm_resiliency.gemini.manager").addHandler(_RejectedShards(events))
    try:
        return _train(args, events)
    except BaseException:  # noqa: BLE001 - report, let GEMINI flush (its excepthook), then exit
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        os._exit(1)


def _train(args, events: EventLog) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lm_resiliency import OrchestrationHooks, enable_resiliency
    from lm_resiliency.faults import CampaignJournal, JsonCampaignStateStore, enable_fault_injection

    rank, world, gen = args.rank, args.world, args.gen
    paths = scenario.paths(args.root, args.label)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=scenario.RUN_TIMEOUT_S))
    model = scenario.build_model()
    ddp = scenario.wrap_ddp(model)
    optimizer = scenario.build_optimizer(model)

    stop = threading.Event()

    def report_fault(report) -> None:
        events.write("fault", report=report.to_json())
        if report.kind in SDC_KINDS:
            stop.set()   # every rank sees the same vote: all stop after this step

    def report_recovery(decision) -> None:
        events.write("decision", decision=decision.to_json())

    session = enable_resiliency(
        ddp, optimizer, interval=scenario.INTERVAL,
        checkpoint=scenario.checkpoint_config(paths["gemini"], run_id=f"demo-{args.label}"),
        replay=scenario.replay_config(),
        orchestration=OrchestrationHooks(report_fault=report_fault, report_recovery=report_recovery))
    scenario.register_traced_allreduce(ddp)
    manager = session.manager
    events.write("resumed", step=session.step_count, recovered_from=session.recovered_from,
                 sources=dict(getattr(manager, "recovery_sources", {}) or {}))

    faults = None
    if args.campaign:
        # The DDP wrapper, like enable_resiliency: the kit's per-iteration faults then strike before
        # GEMINI issues the previous step's capture, as they would on an unwrapped model.
        faults = enable_fault_injection(
            ddp, optimizer, campaign=scenario.build_campaign(), rank=rank, world_size=world,
            executor=scenario.executor(paths["gemini"]),
            state_store=JsonCampaignStateStore(paths["state"]), journal=CampaignJournal(paths["journal"]),
            start_iteration=session.step_count, generation=str(gen), sandbox_dir=paths["sandbox"])

    finished = True
    for step in range(session.step_count + 1, args.steps + 1):
        x, y = scenario.batch(step, rank)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()                        # DDP averages the gradients
        optimizer.step()                       # SCOUT checks before it, GEMINI captures after it
        optimizer.zero_grad(set_to_none=True)
        events.write("step", step=step, loss=loss.item())
        if stop.is_set():
            finished = False
            events.write("stop", step=step, reason="sdc",
                         verified=session.ledger.verified_steps() if session.ledger is not None else [])
            break

    if faults is not None:
        faults.close()
    session.close()
    if finished:
        os.makedirs(paths["final"], exist_ok=True)
        target = os.path.join(paths["final"], f"rank{rank}.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, target + ".tmp")
        os.replace(target + ".tmp", target)
        events.write("finished", step=args.steps)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if finished else RESTART_EXIT_CODE)


def fingerprint(path: str) -> Dict[str, str]:
    """sha256 of every tensor (and a repr of every other value) of a saved final state."""
    import hashlib

    import torch

    state = torch.load(path, weights_only=True)
    out: Dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous()
            digest = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            out[prefix] = f"tensor {t.dtype}{list(t.shape)} sha256:{digest}"
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}" if prefix else str(key), value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}[{i}]", item)
        else:
            out[prefix] = repr(value)

    walk("", state)
    return out
