"""The full-catalog sweep of a replay workload: every recipe of every replay module, on the
workload's peers, for `prepare_recovery("hang"|"uncertain")`.

Same protocol as the dense sweep (`scout.sweep`: c10d store, bounded waits, vote per entry); what
differs is the recording (each replay module's newest call at a check step, instead of the root
model's forward) and the replay (each recipe materialized from that call, the module alone).
`CombinedSweep` runs the dense sweep and this one and reports the worse outcome.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from lm_resiliency.recovery import SweepOutcome
from lm_resiliency.scout.invocation import (
    SeededRng,
    autocast_regions,
    clone_inputs,
    module_device,
    preserved_buffers,
    tensors_in,
    to_device,
)
from lm_resiliency.scout.moe_replay import EXPERT_CHECK, WorkloadReplayDetector
from lm_resiliency.scout.reports import ReplayResult
from lm_resiliency.scout.signature import structure_signature
from lm_resiliency.scout.sweep import FullCatalogSweep, RecordedInvocation, SweepReport, _Incomplete

logger = logging.getLogger(__name__)

# Worst first: any SDC decides; a sweep that did not complete (or did not run) never selects LATEST.
_SEVERITY = (SweepOutcome.SDC, SweepOutcome.INCOMPLETE, SweepOutcome.NOT_RUN, SweepOutcome.CLEAN)


class WorkloadSweep(FullCatalogSweep):
    """Records every replay module's call at check steps; the sweep replays every (module,
    recipe) entry of the workload on every peer and votes on each."""

    def __init__(self, detector: WorkloadReplayDetector, timeout_s: float) -> None:
        super().__init__(detector, timeout_s)
        self._workload = detector.workload
        self._modules = [(EXPERT_CHECK, label, module) for label, module in detector._candidates(EXPERT_CHECK)]
        self._recipes = {label: index for label, _, index in detector._labels}
        self._owner = {label: detector.workload.replay_modules.index(module) for label, module, _ in detector._labels}
        self._handles: List[Any] = []
        self._recorded: Dict[int, tuple] = {}

    def record(self, step: int) -> None:
        self._remove_hook()
        self._armed_step, self._recorded = step, {}
        for index, module in enumerate(self._workload.replay_modules):
            def hook(module: nn.Module, args: tuple, kwargs: dict, index: int = index) -> None:
                self._record_call(index, args, kwargs)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))

    def _record_call(self, index: int, args: tuple, kwargs: dict) -> None:
        if self._replaying or index in self._recorded:
            return
        self._recorded[index] = (clone_inputs(args, True), clone_inputs(kwargs, True))
        if len(self._recorded) == len(self._workload.replay_modules):
            calls = [self._recorded[i] for i in range(len(self._recorded))]
            self.latest = RecordedInvocation(self._armed_step or 0, tuple(c[0] for c in calls),
                                             {str(i): c[1] for i, c in enumerate(calls)}, autocast_regions(), True)
            self._remove_hook()

    def _remove_hook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _replay(self, header: dict, payload: bytes, source: int) -> dict:
        doc: Dict[str, Any] = {"modules": [], "error": None}
        invocation = self._invocation(header, payload, source)
        try:
            calls = list(zip(invocation["args"], [invocation["kwargs"][str(i)] for i in
                                                  range(len(invocation["args"]))]))
        except (TypeError, KeyError) as exc:
            raise _Incomplete(f"the calls published by rank {source} are malformed: {exc}") from exc
        if len(calls) != len(self._workload.replay_modules):
            raise _Incomplete(f"rank {source} published {len(calls)} calls for {len(self._workload.replay_modules)} "
                              "replay modules")
        for check, label, module in self._modules:
            params = structure_signature(list(module.parameters()))
            out: Optional[str] = None
            recipe = self._workload.recipes[self._recipes[label]]
            args, kwargs = calls[self._owner[label]]
            device = module_device(module)
            self._replaying = True
            try:
                args, kwargs = self._workload.materializer.materialize(
                    to_device(tuple(args), device), to_device(dict(kwargs), device), recipe)
                with preserved_buffers(module), torch.no_grad(), SeededRng(self.config.seed + int(header["step"]),
                                                                           device):
                    out = structure_signature(tensors_in(module(*args, **kwargs)))
            except Exception as exc:  # noqa: BLE001 - the peers learn it and the sweep is incomplete
                logger.warning("SCOUT workload sweep: %s raised on rank %d: %s", label, self.rank, exc)
                doc["error"] = f"{label}: {type(exc).__name__}: {exc}"[:500]
            finally:
                self._replaying = False
            doc["modules"].append([check, label, params, out])
        return doc


class CombinedSweep:
    """The dense sweep and the workload sweep behind one `record` / `run` / `close`."""

    def __init__(self, sweeps: List[FullCatalogSweep]) -> None:
        self.sweeps = sweeps

    def record(self, step: int) -> None:
        for sweep in self.sweeps:
            sweep.record(step)

    def run(self, step: int) -> SweepReport:
        reports = [sweep.run(step) for sweep in self.sweeps]
        worst = min(reports, key=lambda r: _SEVERITY.index(r.outcome))
        checks = tuple(c for r in reports if r.result is not None for c in r.result.checks)
        return SweepReport(worst.outcome, "; ".join(r.reason for r in reports),
                           ReplayResult(step=step, checks=checks) if checks else None)

    def close(self) -> None:
        for sweep in self.sweeps:
            sweep.close()
