"""ScoutHarness: every SCOUT component one training run needs, driven by the session.

Per optimizer step k:
  before the forward of k   `before_forward(k)`        arm replay capture if a check is due
  after backward of k       `before_optimizer_step(k)` without DDP's bucket trace, step k's own
                                                       work and first non-finite send (local_trace.py);
                                                       replay + vote, compute-straggler timing,
                                                       collective probe (every `probe_interval`
                                                       steps) -> ReplayResult
  after optimizer step k    `after_optimizer_step(k)`  progress for the out-of-band monitor;
                                                       under DDP, this step's own-work time and
                                                       the non-finite origin check (ddp_trace.py)
The out-of-band monitor runs on its own thread over the c10d store, so it keeps working while
the training thread is stuck in a collective. Under DDP a comm hook marks each gradient bucket
for it. The per-rank own-work times (and, without the bucket trace, the first non-finite sends)
are exchanged at check steps: whole-rank stragglers and non-finite origins.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import statistics
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import torch.distributed as dist
from torch import nn

from lm_resiliency import wire
from lm_resiliency._torch_compat import default_store, root_mesh, uses_python_reducer
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.ddp_trace import GradientBucketTrace, StepTrace, install_ddp_trace
from lm_resiliency.scout.instrument import checkpoint_io, instrument_dataloader, trace_collectives
from lm_resiliency.scout.moe_replay import WorkloadReplayDetector, workload_peer_groups
from lm_resiliency.scout.moe_sweep import CombinedSweep, WorkloadSweep
from lm_resiliency.scout.local_trace import LocalWorkTrace, non_finite_origins
from lm_resiliency.scout.monitor import DEFAULT_PREFIX, OOBMonitor, ProgressBeacon
from lm_resiliency.scout.peers import UnknownLayoutError, peer_groups_from_topology
from lm_resiliency.scout.probes import CollectiveProbe, default_probe_groups
from lm_resiliency.scout.alltoall import AllToAllRecorder, AllToAllReplayer
from lm_resiliency.scout.replay import ReplayDetector, ReplayUnsupportedError
from lm_resiliency.scout.reports import (
    NON_FINITE_CHECK,
    SCOPE_RANK,
    SDC,
    CheckOutcome,
    ReplayResult,
    SCOUTFaultReport,
)
from lm_resiliency.scout.stragglers import CommunicationStragglerLocalizer, ComputeStragglerDetector
from lm_resiliency.scout.sweep import FullCatalogSweep
from lm_resiliency.wrappers import find_ddp

logger = logging.getLogger(__name__)

_SESSIONS = itertools.count()


def _declared_experts(model: nn.Module, topology: Optional[Mapping[str, Any]]) -> tuple:
    """The expert modules an adapter names (descriptor `expert_modules`, paths in `model`, e.g.
    DeepSpeed's): they differ across expert-parallel ranks, so dense replay leaves them out."""
    paths = list((topology or {}).get("expert_modules") or ())
    modules = dict(model.named_modules())
    missing = [p for p in paths if p not in modules]
    if missing:
        raise ReplayUnsupportedError(f"the topology names expert modules {missing} that the replayed model does not "
                                     "have, so dense replay cannot tell which modules differ across expert ranks")
    return tuple(modules[p] for p in paths)


def _parameter_mesh(model: nn.Module) -> Optional[tuple]:
    """(shape, dim names, ranks in mesh order) of the root device mesh of the model's DTensor
    parameters; None without DTensors. Parameters on unrelated meshes: UnknownLayoutError."""
    roots = {}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if type(p).__name__ == "DTensor" and mesh is not None:
            root = root_mesh(mesh)
            roots[id(root)] = root
    if not roots:
        return None
    if len(roots) > 1:
        raise UnknownLayoutError(f"the model's DTensor parameters live on {len(roots)} unrelated device meshes")
    root = next(iter(roots.values()))
    return list(root.shape), list(root.mesh_dim_names or []), root.mesh.flatten().tolist()


class ScoutHarness:
    """Collective to construct (creates gloo subgroups in the same order on every rank).

    `peer_group`: this rank's replay peers as a Gloo group the caller created on every rank;
    SCOUT then compares replays within it instead of the groups it derives from `topology`."""

    def __init__(self, model: nn.Module, optimizer: Any, config: ReplayHarnessConfig, *,
                 on_oob_report: Callable[[SCOUTFaultReport], None], topology: Optional[Mapping[str, Any]] = None,
                 peer_group: Optional[dist.ProcessGroup] = None, probe_collectives: bool = True) -> None:
        self.config = config
        self.beacon = ProgressBeacon()
        self.detector: Optional[ReplayDetector] = None
        self.monitor: Optional[OOBMonitor] = None
        self._probe: Optional[CollectiveProbe] = None
        self._trace = None
        self._ddp_trace: Optional[GradientBucketTrace] = None
        self._local: Optional[LocalWorkTrace] = None
        self._origin_reported = False
        self._work_samples: List[float] = []
        self._armed_work_samples: List[float] = []   # steps whose forward captured for a replay
        self._armed = False
        self._groups: List[Any] = []
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        # Setup waits (torch's default: 30 minutes) give up only once the hang monitor would have
        # reported a stall and a full sweep could have localized it.
        bound = config.hang_stall_threshold_s + config.full_sweep_timeout_s
        hosts = self._gather_hosts(distributed, bound)
        group_ranks = [self.rank]
        replay_group = None
        peer_groups: Optional[List[List[int]]] = None
        if not config.replay_enabled:
            logger.info("SCOUT: periodic replay is off (check_interval=0 and no check class has an interval of its "
                        "own): no replay checks, replay-timed stragglers or checkpoint certification; the "
                        "out-of-band hang/stall monitor stays on")
        else:
            try:
                if peer_group is not None:
                    # The caller's group (Gloo, created on every rank): its ranks replace the topology's.
                    replay_group, group_ranks = peer_group, dist.get_process_group_ranks(peer_group)
                    peer_groups = [group_ranks]
                else:
                    peer_groups = peer_groups_from_topology(dict(topology) if topology else {}, self.world_size,
                                                            _parameter_mesh(model))
            except UnknownLayoutError as exc:
                # Every rank sees the same layout, so every rank skips the group creation below alike.
                logger.warning("SCOUT: replay checks, replay-timed stragglers and checkpoint certification are off: "
                               "%s (the out-of-band hang/stall monitor stays on)", exc)
        if self.world_size > 1 and peer_groups is not None and peer_group is None:
            for ranks in peer_groups:
                created = wire.new_group(ranks, bound, "SCOUT's replay peer group")
                self._groups.append(created)
                if self.rank in ranks:
                    replay_group, group_ranks = created, list(ranks)
        if peer_groups is not None:
            try:
                workload = config.workload
                expert = workload.replay_modules if workload is not None and workload.peer_role == "expert" else ()
                self.detector = ReplayDetector(model, optimizer, config, group=replay_group, group_ranks=group_ranks,
                                               exclude=tuple(expert) + _declared_experts(model, topology))
            except ReplayUnsupportedError as exc:
                logger.warning("SCOUT: replay checks disabled: %s", exc)
            else:
                cover = self.detector.coverage()
                missing = f"; not reached: {cover['uncovered'][:8]}" if cover["uncovered"] else ""
                logger.info("SCOUT: one rotation (%d checks, %d steps) replays %.1f%% of the parameters "
                            "(%.1f%% of their bytes)%s", cover["checks"], cover["steps"], 100 * cover["parameters"],
                            100 * cover["bytes"], missing)
        self.compute = ComputeStragglerDetector(config, group_ranks, hosts)
        # Rank-level stragglers: each rank's own work per step, compared across the same peers.
        self.rank_work = ComputeStragglerDetector(config, group_ranks, hosts, measure="rank_step_work")
        self._replay_group = replay_group
        self._exchange_timeout_s = bound
        self.host = hosts.get(self.rank, "")
        self._hosts = hosts
        self.communication = CommunicationStragglerLocalizer(config, hosts)
        self.workload_detector = self._workload_detector(model, optimizer, topology, bound)
        self._all_to_all: Optional[AllToAllReplayer] = None
        self._all_to_all_recorder: Optional[AllToAllRecorder] = None
        self.all_to_all_links = CommunicationStragglerLocalizer(config, hosts, measure="all_to_all_replay")
        if distributed and self.world_size > 1 and config.all_to_all_policy is not None and config.replay_enabled:
            exchange = wire.new_group(None, bound, "SCOUT's AllToAll replay exchange")
            self._groups.append(exchange)
            self._all_to_all = AllToAllReplayer(config.all_to_all_policy, exchange, bound)
        if self.world_size > 2 and probe_collectives:
            self._probe = CollectiveProbe(default_probe_groups(self.world_size), rounds=3)
        if distributed:
            store = default_store()
            # Sessions are created in the same order on every rank: the count keys their snapshots apart.
            prefix = f"{DEFAULT_PREFIX}/session-{next(_SESSIONS)}"
            self.monitor = OOBMonitor(store, self.rank, self.world_size, config, self.beacon,
                                      on_report=on_oob_report, host=hosts.get(self.rank), prefix=prefix).start()
            self._trace = trace_collectives(self.beacon)
            self._ddp_trace = install_ddp_trace(model, self.beacon)
            ddp = find_ddp(model)
            if self._ddp_trace is None and (ddp is None or not uses_python_reducer(ddp)):
                # No bucket trace (no DDP, or a comm hook came first): time each rank's own work
                # and check what it sends from its Python collectives, or its DDP gradients.
                self._local = LocalWorkTrace(self.beacon)
                self._trace.observer = self._local
                if ddp is not None:
                    self._local.watch_gradients(ddp.module)
        # The full-catalog sweep prepare_recovery runs replays what the detector's peers share.
        sweeps: List[FullCatalogSweep] = []
        if self.detector is not None:
            sweeps.append(FullCatalogSweep(self.detector, config.full_sweep_timeout_s))
        if self.workload_detector is not None:
            sweeps.append(WorkloadSweep(self.workload_detector, config.full_sweep_timeout_s))
        self.sweep: Optional[Any] = (CombinedSweep(sweeps) if len(sweeps) > 1 else sweeps[0]) if sweeps else None

    def _workload_detector(self, model: nn.Module, optimizer: Any, topology: Optional[Mapping[str, Any]],
                           bound: float) -> Optional[WorkloadReplayDetector]:
        """The `ReplayHarnessConfig.workload` detector on its peer groups (expert-data-parallel for
        an expert workload); None without a workload or when the layout is unknown (warned)."""
        workload = self.config.workload
        if workload is None or self.config.check_interval == 0:   # it follows the base cadence: off at 0
            return None
        try:
            groups = workload_peer_groups(workload, dict(topology) if topology else {}, self.world_size,
                                          _parameter_mesh(model))
        except UnknownLayoutError as exc:
            logger.warning("SCOUT: %s workload replay is off: %s", workload.peer_role, exc)
            return None
        group, ranks = None, [self.rank]
        if self.world_size > 1:
            for members in groups:
                created = wire.new_group(members, bound, f"SCOUT's {workload.peer_role} replay peer group")
                self._groups.append(created)
                if self.rank in members:
                    group, ranks = created, list(members)
        detector = WorkloadReplayDetector(model, optimizer, self.config, workload, group=group, group_ranks=ranks)
        logger.info("SCOUT: %s replay among ranks %s: %s", workload.peer_role, ranks, workload.describe())
        return detector

    @property
    def catalog_size(self) -> int:
        """K, the replay recipes in one certification cycle: the workload's recipes, else 1 (dense)."""
        return self.workload_detector.cycle_length if self.workload_detector is not None else 1

    @property
    def catalog_dynamic(self) -> bool:
        """A workload (MoE) catalog: certified through CANDIDATE even when it has one recipe."""
        return self.workload_detector is not None

    def cycle_complete(self, step: int) -> bool:
        """Whether the check at `step` ran the last recipe of a workload cycle (always, when dense)."""
        detector = self.workload_detector
        if detector is None:
            return True
        return bool(detector.checks_due(step)) and detector.recipe_index(step) == detector.cycle_length - 1

    def coverage(self) -> Optional[Dict[str, Any]]:
        """What one rotation of the replay checks covers (`ReplayDetector.coverage`); None when
        replay checks are off."""
        return self.detector.coverage() if self.detector is not None else None

    def _gather_hosts(self, distributed: bool, timeout_s: float) -> Dict[int, str]:
        host = socket.gethostname()
        if not distributed:
            return {0: host}
        try:
            names = wire.all_gather_json(host, timeout_s=timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"SCOUT setup: gathering every rank's host name did not complete within "
                               f"{timeout_s}s; every rank constructs SCOUT together, so another rank failed, "
                               f"restarted alone or has not reached it ({exc})") from exc
        return dict(enumerate(names))

    def before_forward(self, step: int) -> None:
        if self._local is not None:
            self._local.leave_gradient_op()   # a no_sync micro-step's gradients were not reduced
        self._armed = self.check_due(step)
        if self._armed:
            if self.sweep is not None:
                self.sweep.record(step)
            if self.detector is not None and self.detector.checks_due(step):
                self.detector.arm(step)
            if self.workload_detector is not None and self.workload_detector.checks_due(step):
                self.workload_detector.arm(step)
            if self._all_to_all is not None:
                self._all_to_all_recorder = AllToAllRecorder()

    def check_due(self, step: int) -> bool:
        return any(d is not None and bool(d.checks_due(step)) for d in (self.detector, self.workload_detector))

    def before_optimizer_step(self, step: int) -> Optional[ReplayResult]:
        """Run the checks due at `step` (collective). None when nothing was due."""
        if self._local is not None:
            own = self._local.boundary(step).own_work_s
            if own is not None:
                (self._armed_work_samples if self._armed else self._work_samples).append(own)
        if not self.check_due(step):
            return None
        recorder, self._all_to_all_recorder = self._all_to_all_recorder, None
        calls = recorder.remove() if recorder is not None else []
        checks: list = []
        with self._own_section("scout_replay", step):
            if self.detector is not None and self.detector.checks_due(step):
                checks += self.detector.run(step).checks
            if self.workload_detector is not None and self.workload_detector.checks_due(step):
                checks += self.workload_detector.run(step).checks
        result = ReplayResult(step, tuple(checks))
        findings = []
        if self._all_to_all is not None:
            with self._own_section("scout_all_to_all", step):
                routing, latencies = self._all_to_all.run(step, step // self.config.round_interval, calls)
            result = ReplayResult(step, result.checks + tuple(routing))
            findings += self.all_to_all_links.observe(latencies)
        checks = list(result.checks)
        timings = next((c.timings_s for c in result.checks if c.check in ("hidden", "output", "embedding", "expert")
                        and c.timings_s), None)
        if timings and len(timings) >= 3:
            findings += self.compute.observe(timings)
        if self._replay_group is not None and len(self.rank_work.group_ranks) >= 2:
            with self._own_section("scout_step_timings", step):
                found, origin = self._rank_work_round()
            findings += found
            checks += origin
        if self._probe is not None and self.config.probe_interval > 0 and step % self.config.probe_interval == 0:
            with self._own_section("scout_probe", step):
                findings += self.communication.observe(self._probe.measure())
        return ReplayResult(step, tuple(checks), tuple(findings))

    def _rank_work_round(self) -> tuple:
        """Exchange each peer's median own work per step since the last check and, without DDP's
        bucket trace, its first non-finite observation (one small gather per check, none per
        step); every peer reaches the same verdict. Returns (straggler findings, origin checks)."""
        # A step whose forward recorded inputs for a replay is slower on every rank, by a noisy
        # amount that would dilute the ratio test: judged on the other steps where there are any.
        samples = self._work_samples or self._armed_work_samples
        local = {"work": statistics.median(samples) if samples else None,
                 "non_finite": None if self._local is None else self._local.first_non_finite,
                 "what": [] if self._local is None else list(self._local.first_what)}
        self._work_samples, self._armed_work_samples = [], []
        values = wire.all_gather_json(local, group=self._replay_group, timeout_s=self._exchange_timeout_s)
        ranks = dist.get_process_group_ranks(self._replay_group)
        docs = dict(zip(ranks, values))
        timings = {r: float(v["work"]) for r, v in docs.items() if v.get("work") is not None}
        findings = [] if len(timings) < 3 else self.rank_work.observe(timings)
        origins = non_finite_origins({r: v.get("non_finite") for r, v in docs.items()})
        if not origins or self._origin_reported:
            return findings, []
        self._origin_reported = True   # afterwards every replica holds the values: reported once
        first = docs[origins[0]]["non_finite"]
        detail = (f"non-finite values first appeared on ranks {list(origins)} at step {first[0]} (in "
                  f"{docs[origins[0]]['what'][:8]}), before they crossed a collective; the other peers "
                  "received them later or not yet")
        logger.error("SCOUT: %s", detail)
        signatures = {r: "finite" if v.get("non_finite") is None else "non-finite from step {}, op {}".format(
            *v["non_finite"]) for r, v in docs.items()}
        return findings, [CheckOutcome(check=NON_FINITE_CHECK, module_path="non_finite", group_ranks=tuple(ranks),
                                       signatures=signatures, verdict=SDC, faulty=origins,
                                       hosts={r: self._hosts.get(r, "") for r in origins}, detail=detail)]

    @contextlib.contextmanager
    def _own_section(self, op: str, step: int) -> Iterator[None]:
        """SCOUT's replay and probe collectives are its own traffic, not training collectives (how
        many a rank makes depends on its peer group): the section is one beacon op, `op`, instead."""
        untraced = self._trace.untraced() if self._trace is not None else contextlib.nullcontext()
        with self.beacon.track(op, step), untraced:
            yield
        if self._ddp_trace is not None:
            self._ddp_trace.released()
        if self._local is not None:
            self._local.released()

    def exclude_groups(self, *groups: Any) -> None:
        """Process groups lm-resiliency owns (GEMINI, certification agreement): their traffic is
        not counted as training collectives by the out-of-band hang rule."""
        if self._trace is not None:
            self._trace.exclude(*groups)

    def after_optimizer_step(self, step: int, skipped: bool = False) -> Optional[SCOUTFaultReport]:
        """Progress for the monitor; returns an SDC report when this rank is where non-finite
        gradients first appeared in step `step` (`skipped`: the optimizer did not apply them)."""
        self.beacon.progress(step)
        if self.monitor is not None:
            self.monitor.check()  # a failed report callback or a dead monitor surfaces here
        if self._local is not None and skipped:
            self._local.skip()
        trace = self._ddp_trace.take_step(skipped) if self._ddp_trace is not None else None
        if trace is None:
            return None
        if trace.own_work_s is not None:
            (self._armed_work_samples if self._armed else self._work_samples).append(trace.own_work_s)
        return self._non_finite_report(trace, step) if trace.origin else None

    def _non_finite_report(self, trace: StepTrace, step: int) -> SCOUTFaultReport:
        report = SCOUTFaultReport(
            kind=SDC, scope=SCOPE_RANK, ranks=(self.rank,), hosts=(self.host,), resource="gradients:non_finite",
            evidence={"check": "non_finite_origin", "buckets": list(trace.non_finite_buckets),
                      "parameters": list(trace.non_finite_parameters),
                      "spread_by_all_reduce": trace.reduced_non_finite,
                      "detail": "non-finite local gradients before DDP's all-reduce, on this rank only: "
                                "the job was finite before this step"},
            confidence=1.0, step=step)
        logger.error("SCOUT: non-finite gradients first appeared on rank %d at step %d (parameters %s)",
                     self.rank, step, list(trace.non_finite_parameters))
        return report

    def instrument_dataloader(self, dataloader: Any, name: str) -> Any:
        return instrument_dataloader(dataloader, self.beacon, name)

    def checkpoint_io(self, kind: str, name: str) -> Any:
        return checkpoint_io(self.beacon, kind, name)

    def close(self) -> None:
        if self._trace is not None:
            self._trace.remove()
            self._trace = None
        if self._ddp_trace is not None:
            self._ddp_trace.remove()
            self._ddp_trace = None
        if self._local is not None:
            self._local.remove()
            self._local = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self.sweep is not None:
            self.sweep.close()
            self.sweep = None
        if self.detector is not None:
            self.detector.close()
            self.detector = None
        if self.workload_detector is not None:
            self.workload_detector.close()
            self.workload_detector = None
        if self._all_to_all_recorder is not None:
            self._all_to_all_recorder.remove()
            self._all_to_all_recorder = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        for group in self._groups:
            if dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError) as exc:
                    logger.debug("SCOUT: replay group already gone: %s", exc)
        self._groups = []
