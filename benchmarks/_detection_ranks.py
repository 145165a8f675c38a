"""The detection campaign's training runs, one rank's side (see benchmarks/detection_bench.py).

`run_cells(rank, world, opts, cells)` trains each cell in turn in the same gloo processes: a
fresh model, DDP (or FSDP2 for `hang fsdp2`), AdamW, `enable_fault_injection` (the kit, attached
first: its gradient faults then land before SCOUT's check of the same step) and
`enable_resiliency(interval=4)`, STEPS steps, then close. It returns, per cell, the SCOUT
reports every rank received, the kit's injection records, a digest of the final parameters and
optimizer state, each step's forward time, the modules SCOUT sampled at each check with their source rank, and what one
rotation of SCOUT's checks covers (`coverage()`).
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from typing import Any, Dict, List

from benchmarks._detection_cells import (HANG_THRESHOLD_S, INTERVAL, QUIET_THRESHOLD_S, STEPS, WORK_S,
                                         campaign_json)

VOCAB, WIDTH, BLOCKS = 64, 16, 3


def build_model() -> Any:
    """An embedding, residual blocks in a ModuleList, a final LayerNorm and a head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.fc = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(self.norm(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.layers:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = Net()
    # The middle block's compute, a sleep so that timings do not depend on the machine's speed.
    model.layers[1].register_forward_pre_hook(lambda module, args: time.sleep(WORK_S))
    return model


def _digest(model: Any, optimizer: Any) -> List[str]:
    import torch

    tensors = [p for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return [hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            for t in tensors]


def _plan(session: Any) -> Dict[str, Dict[str, list]]:
    """Each check step's activation checks: check -> [module path, source rank]."""
    detector = session.scout.detector if session.scout is not None else None
    if detector is None:
        return {}
    plan = {}
    for step in range(INTERVAL, STEPS + 1, INTERVAL):
        plan[str(step)] = {c: [detector.sampled(c, step)[0], detector.source(c, step)]
                           for c in detector.checks_due(step) if c != "optimizer"}
    return plan


def _brief(report: dict) -> dict:
    """What scoring needs of a report, plus the timing evidence that explains a straggler."""
    evidence = report.get("evidence") or {}
    return dict({k: report[k] for k in ("kind", "scope", "ranks", "resource", "step", "detected_at")},
                evidence={k: evidence[k] for k in _EVIDENCE if k in evidence})


_EVIDENCE = ("measure", "current_s", "group_median_s", "threshold_s", "rounds", "rule")


def run_cell(rank: int, world: int, cell: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lm_resiliency import ReplayHarnessConfig, enable_resiliency
    from lm_resiliency.faults import FaultCampaign, enable_fault_injection
    from lm_resiliency.scout.reports import replay_fault_reports

    model = build_model()
    if cell.get("framework") == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        wrapped = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reports: List[dict] = []
    forward_s: List[float] = []  # local work: no collective runs in the forward (no buffers to broadcast)
    manifest = campaign_json(cell)
    faults = (enable_fault_injection(wrapped, optimizer, campaign=FaultCampaign.from_json(manifest),
                                     rank=rank, world_size=world) if manifest is not None else None)
    threshold = HANG_THRESHOLD_S if cell["class"] == "hang" else QUIET_THRESHOLD_S
    session = enable_resiliency(
        wrapped, optimizer, interval=INTERVAL, enable_checkpoint=False,
        fault_callback=lambda result: reports.extend(r.to_json() for r in replay_fault_reports(result)),
        oob_fault_callback=lambda r: reports.append(r.to_json()),
        replay=ReplayHarnessConfig(hang_stall_threshold_s=threshold, monitor_poll_interval_s=0.2))
    try:
        plan = _plan(session)
        coverage = session.scout.coverage() if session.scout is not None else None
        for step in range(1, STEPS + 1):
            gen = torch.Generator().manual_seed(1000 * rank + step)
            tokens = torch.randint(0, VOCAB, (4, 8), generator=gen)
            targets = torch.randint(0, VOCAB, (4, 8), generator=gen)
            started = time.perf_counter()
            logits = wrapped(tokens)
            forward_s.append(time.perf_counter() - started)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        state = _digest(model, optimizer) if cell.get("framework") != "fsdp2" else []
    finally:
        session.close()
        if faults is not None:
            faults.close()
    injections = [{"status": r.status.value, "iteration": r.iteration, "wall_time": r.wall_time}
                  for r in (faults.records if faults is not None else ())]
    dist.barrier()
    return {"reports": [_brief(r) for r in reports],
            "injections": injections, "state": state, "plan": plan, "forward_s": forward_s,
            "coverage": coverage}


def run_cells(rank: int, world: int, opts: dict, cells: List[dict]) -> List[dict]:
    """`run_cell` for each of `cells` in turn, in these processes (benchmarks._ranks.run_ranks)."""
    from benchmarks._ranks import log

    logging.getLogger("lm_resiliency").setLevel(logging.ERROR)  # each trial's reports are scored, not logged
    # The head's output is a view; nothing here modifies it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    results = []
    for cell in cells:
        results.append(run_cell(rank, world, cell))
        if rank == 0:
            log("detection", f"ran {cell['class']} {cell.get('kind', '')} {cell.get('surface', '')} "
                             f"{cell.get('position', '')} {cell.get('lifetime', '')} rank {cell['faulty']}")
    return results
