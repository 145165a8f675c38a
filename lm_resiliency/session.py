"""ResiliencySession: the one object every framework surface drives.

Lifecycle of a capture at optimizer step k (k a multiple of `interval`):
  after optimizer step k   -> snapshot RNG streams (they must not include the next batch)
  before the next forward  -> read model/optimizer (unchanged since step k), the deferred
                              framework state (LR scheduler stepped after the optimizer) and
                              caller state, and start the asynchronous GEMINI capture
  before optimizer step k+1 -> wait for the copy (GEMINI's maybe_wait)
The capture is also completed at `flush_for_restart()`, `close()` and interpreter exit, so
the last step of a run is never left half-captured.

Why one module of this size: the step lifecycle (capture cadence, SCOUT before GEMINI, recovery
order) is one state machine whose ordering rules must be read together.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import shutil
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, Optional, Protocol, Tuple, runtime_checkable

import torch
import torch.distributed as dist

from lm_resiliency._values import is_int
from lm_resiliency import wire
from lm_resiliency.adapter import FrameworkAdapter, SessionControls, StepCallbacks, check_extra_state
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.files import RecordRejected, atomic_write, ensure_private_dir, open_owned
from lm_resiliency.events import EVENT_FILE, OLD_EVENT_FILE
from lm_resiliency.gemini.identity import FIX
from lm_resiliency.gemini.integrity import NonFiniteState, nonfinite_indices, nonfinite_values
from lm_resiliency.gemini.manager import InMemoryCheckpointManager, RecoveryUnavailable
from lm_resiliency.inventory import fresh_start_hint
from lm_resiliency.manager_api.hooks import OrchestrationHooks, dispatch_replay_faults
from lm_resiliency.recovered_state import OverwriteGuard
from lm_resiliency.recovery import FailureClass, RecoveryDecision, RecoveryMode, SweepOutcome, select_mode
from lm_resiliency.scout.config import CHECK_CLASSES, ReplayHarnessConfig
from lm_resiliency.scout.harness import ScoutHarness
from lm_resiliency.scout.replay import ReplayError
from lm_resiliency.scout.reports import ReplayResult, SCOUTFaultReport, replay_fault_reports
from lm_resiliency.scout.sweep import SweepReport
from lm_resiliency.session_activity import SessionActivity
from lm_resiliency.trust import CertificationLedger, DurableCheckpointConfig, verdict_of, worst
from lm_resiliency.trust.handoff import recovery_decision

logger = logging.getLogger(__name__)


@runtime_checkable
class ResiliencyHandle(Protocol):
    """The lifecycle surface every framework integration returns."""

    step_count: int
    last_recovery_decision: Optional[RecoveryDecision]

    def instrument_dataloader(self, dataloader: Any, name: str = "train") -> Any: ...
    def checkpoint_io(self, kind: str, name: str = "checkpoint") -> Any: ...
    def flush_for_restart(self) -> int: ...
    def set_restart_destination(self, resolver: Optional[Callable[[], Optional[str]]]) -> None: ...
    def copy_checkpoint_to(self, destination: Optional[str] = None) -> list: ...
    def prepare_recovery(self, failure: str, all_ranks_accessible: bool = True) -> RecoveryMode: ...
    def close(self) -> None: ...


def capture_rng() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    state["numpy"] = np.random.get_state()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    # Recovered tensors can be views into one payload buffer; RNG setters need their own storage.
    torch.set_rng_state(state["torch"].clone())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.clone() for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


class ResiliencySession:
    """Owns hooks, the GEMINI manager and their threads and process groups for one training run."""

    def __init__(self, adapter: FrameworkAdapter, *, checkpoint: Optional[InMemoryCkptConfig] = None,
                 replay: Optional[ReplayHarnessConfig] = None,
                 enable_checkpoint: bool = True, enable_detection: bool = True,
                 extra_state_fn: Optional[Callable[[], Dict[str, Any]]] = None,
                 load_extra_state_fn: Optional[Callable[[Dict[str, Any]], None]] = None,
                 load_fallback: Optional[Callable[[], Any]] = None,
                 recovery_mode: Optional[RecoveryMode] = None, orchestration: Any = None,
                 fault_callback: Optional[Callable[[ReplayResult], None]] = None,
                 oob_fault_callback: Optional[Callable[[SCOUTFaultReport], None]] = None,
                 durable_checkpoint: Optional[DurableCheckpointConfig] = None) -> None:
        self.adapter = adapter
        self.step_count = 0
        self.last_recovery_decision: Optional[RecoveryDecision] = None
        self.recovered_from: Optional[str] = None
        self.config = checkpoint if checkpoint is not None else InMemoryCkptConfig()
        self.enable_detection = enable_detection
        self._extra_state_fn = extra_state_fn
        self._load_extra_state_fn = load_extra_state_fn
        self._load_fallback = load_fallback
        self._recovery_mode = RecoveryMode(recovery_mode) if recovery_mode is not None else RecoveryMode.LATEST
        self._orchestration = _as_hooks(orchestration)
        self._fault_callback = fault_callback
        self._oob_fault_callback = oob_fault_callback
        self.replay_config = replay if replay is not None else ReplayHarnessConfig()
        self._restart_destination: Optional[Callable[[], Optional[str]]] = None
        self._pending: Optional[Dict[str, Any]] = None
        self._boundary_verdict = "incomplete"
        self.last_replay_result: Optional[ReplayResult] = None
        # SCOUT checks that failed for an internal reason (logged at ERROR); such a boundary is
        # captured uncertified, never counted as SDC evidence.
        self.scout_check_errors = 0
        self._lock = threading.RLock()
        self._closed = False
        self._guard: Optional[OverwriteGuard] = None
        self.activity = SessionActivity(self.config.interval)  # event log, cadence lines, close summary
        self.manager: Optional[InMemoryCheckpointManager] = None
        self.scout: Optional[ScoutHarness] = None
        self.ledger: Optional[CertificationLedger] = None
        self._agreement_group = None
        self._durable = durable_checkpoint
        try:
            topology = adapter.topology()
            if enable_checkpoint and self.config.enable:
                self.manager = InMemoryCheckpointManager(
                    self.config, topology=topology.descriptor, replicate=topology.replicate)
            if enable_detection:
                model, optimizer = adapter.replay_targets()
                self.scout = ScoutHarness(model, optimizer, self.replay_config, on_oob_report=self._on_oob_report,
                                          topology=topology.descriptor, peer_group=topology.scout_group)
                if self.manager is not None:
                    self.scout.exclude_groups(self.manager.process_group)
            if self.manager is not None and self.scout is not None and self.scout.detector is not None:
                _check_cadence(self.config.interval, self.replay_config)
                if dist.is_initialized() and dist.get_world_size() > 1:
                    self._agreement_group = wire.new_group(None, self.config.timeout_s,
                                                           "the checkpoint-trust agreement group")
                    self.scout.exclude_groups(self._agreement_group)
                self.ledger = CertificationLedger(self.scout.catalog_size, self.manager.node_store(),
                                                  group=self._agreement_group, durable=durable_checkpoint,
                                                  dynamic=self.scout.catalog_dynamic)
                self.manager.protected_steps = self._protected_steps
            elif durable_checkpoint is not None:
                raise ValueError("durable_checkpoint= needs SCOUT replay and GEMINI (certification requires an "
                                 "accepted replay check at each checkpoint boundary)")
            if self.manager is not None and self.manager.store is not None:
                self.activity.open(self.manager, layout=topology.kind, framework=adapter.describe(),
                                   detection=self.scout is not None)
            controls = SessionControls(lambda: self.step_count, self.continue_from, self.keep_state_for_relaunch,
                                       self.close)
            timed = self.activity.timed
            adapter.install(StepCallbacks(timed(self._before_optimizer_step), timed(self._after_optimizer_step),
                                          timed(self._before_forward), timed(self._skipped_optimizer_step), controls))
        except BaseException:
            try:
                self.close()
            except Exception:  # the construction error is the one to raise
                logger.exception("lm-resiliency: close() after a failed start also failed")
            raise
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---------------------------------------------------------------- recovery

    def recover(self, step: Optional[int] = None) -> Optional[int]:
        """Collective: load the newest state every rank can load, else call `load_fallback`.
        Sets and returns `step_count` (None when starting fresh). Rank 0 logs one WARNING-level
        line saying which (so it shows with Python's default logging): "resumed run X at step N
        from memory / peer memory / disk / peer disk / fallback", or "started fresh: <why>".
        With `step` (a step a manager selected), exactly that GEMINI step is loaded, or
        RecoveryUnavailable is raised: no other step, no fallback."""
        exact = step
        step = None
        self._disarm_guard()  # the session's own loads below are never refused
        verified_only = self._recovery_mode is RecoveryMode.RECOVERY_VERIFIED or (
            self.ledger is not None and self.ledger.requires_verified_recovery)
        if exact is not None and self.manager is None:
            raise RecoveryUnavailable(f"step {exact} was selected for recovery, but GEMINI checkpointing is off")
        loaded: Optional[Tuple[int, Any]] = None  # the GEMINI step found, and the state it holds
        if self.manager is not None:
            # GEMINI's transfers are not training collectives for SCOUT's hang rule; the recovery
            # shows as one checkpoint read instead (its own stall threshold; ending it is progress).
            with self.checkpoint_io("read", name="gemini_recovery"):
                if exact is not None:
                    allowed = self.ledger.verified_steps() if verified_only and self.ledger is not None else None
                    step = self.manager.find_latest(step=exact, allowed_steps=allowed)
                else:
                    step = self._find_verified() if verified_only else self.manager.find_latest()
                if step is not None:
                    loaded = step, self.manager.load()
        if verified_only and loaded is None:
            step = self._recover_verified_durable()
            self.activity.resumed(step, "durable", "the certified durable checkpoint")
            self._announce(f"resumed {self._run_name()}at step {step} from the certified durable checkpoint "
                           "(no RECOVERY_VERIFIED GEMINI state)")
            return step
        if loaded is not None:
            step, state = loaded
            self.adapter.load_framework_state(state["framework"])
            self.adapter.load_deferred_state(state["deferred"])
            if not self.adapter.defers_rng_restore:
                restore_rng(state["rng"])
            if self._load_extra_state_fn is not None:
                self._load_extra_state_fn(state["extra"])
            self.step_count = step
            self.recovered_from = "gemini"
            if self.ledger is not None:
                self.ledger.resume_from(step)
            sources = self._sources_text()
            self.activity.resumed(step, "gemini", sources)
            targets = self.adapter.overwrite_targets()
            if targets:
                self._guard = OverwriteGuard(targets, step=step,
                                             what=f"{self._run_name()}at GEMINI step {step} (from {sources})")
            self._announce(f"resumed {self._run_name()}at step {step} from {sources} "
                           f"({self.adapter.describe()})")
            return step
        why = self._fresh_reason()
        if self._load_fallback is not None:
            with self.checkpoint_io("read", name="load_fallback"):
                result = self._load_fallback()
            self.recovered_from = "fallback"
            if is_int(result):
                self.step_count = result
                message = f"resumed {self._run_name()}at step {result} from fallback (load_fallback): {why}"
            else:
                message = f"no GEMINI state to resume ({why}); load_fallback ran and returned no step"
            self.activity.resumed(self.step_count, "fallback", why)
            self._announce(message)
            return self.step_count
        self.activity.fresh(self.step_count, why)
        self._announce(f"started fresh: {why}")
        return None

    def _gemini(self) -> InMemoryCheckpointManager:
        """The GEMINI manager; only a session with checkpointing on has one."""
        if self.manager is None:
            raise RuntimeError("lm-resiliency: this session has no GEMINI manager: checkpointing is off "
                               "(enable_checkpoint=False or InMemoryCkptConfig.enable=False)")
        return self.manager

    def _disarm_guard(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.remove()

    def _run_name(self) -> str:
        return f"run {self.manager.run_id!r} " if self.manager is not None else ""

    def _sources_text(self) -> str:
        """'memory', or e.g. 'memory (ranks 0, 2), peer memory (rank 1)' when ranks differ."""
        by_label: Dict[str, list] = {}
        for owner, (holder, medium) in sorted(self._gemini().job_recovery_sources.items()):
            where = "disk" if medium == "disk" else "memory"
            by_label.setdefault(where if holder == owner else f"peer {where}", []).append(owner)
        if len(by_label) == 1:
            return next(iter(by_label))
        return ", ".join(f"{label} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
                         for label, ranks in by_label.items())

    def _fresh_reason(self) -> str:
        manager = self.manager
        if manager is None:
            return "GEMINI checkpointing is disabled"
        if manager.steps_seen:
            return (f"GEMINI holds steps {manager.steps_seen} of run {manager.run_id!r}, but none that every rank "
                    "can load")
        reason = (f"no GEMINI state of run {manager.run_id!r} (from {manager.identity.source}) in memory, "
                  f"shared memory or {manager.config.disk_folder}")
        hint = self._other_state_hint(manager) if manager.rank == 0 else ""
        if hint:
            reason += f"; {hint}"
        if not manager.identity.stable:
            reason += f"; this run id is new for every launch, so no relaunch can resume: {FIX}"
        return reason

    def _other_state_hint(self, manager: InMemoryCheckpointManager) -> str:
        """State in the same folders that this start could not use (another topology of this run,
        another run's state when this run id is new): what `lm-resiliency inspect` shows."""
        try:
            return fresh_start_hint(manager.config.disk_folder, manager.config.shared_memory_dir,
                                    run_id=manager.run_id, topology=manager.topology, world_size=manager.world_size,
                                    framework=self.adapter.describe(), stable=manager.identity.stable)
        except Exception as exc:  # noqa: BLE001 - a hint must never stop a start
            logger.debug("lm-resiliency: no hint about other GEMINI state: %s", exc)
            return ""

    @staticmethod
    def _announce(message: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("lm-resiliency: %s", message)

    def _find_verified(self) -> Optional[int]:
        verified = self.ledger.verified_steps() if self.ledger is not None else []
        return self._gemini().find_latest(allowed_steps=verified) if verified else None

    def _recover_verified_durable(self) -> int:
        """No RECOVERY_VERIFIED GEMINI state: only a certified durable checkpoint may be loaded."""
        if self.ledger is None or self._durable is None:
            raise RecoveryUnavailable(
                "recovery needs a RECOVERY_VERIFIED checkpoint (recovery_mode=RECOVERY_VERIFIED or SDC was "
                "detected), and this run has none in GEMINI and no durable_checkpoint= to certify one; refusing "
                "to load an uncertified state or to call the unconstrained load_fallback")
        with self.checkpoint_io("read", name="verified_durable"):
            step = self.ledger.load_verified_durable()
        self.step_count = step
        self.recovered_from = "durable"
        return step

    def _protected_steps(self) -> set:
        """GEMINI keeps the newest RECOVERY_VERIFIED step and the candidate when it prunes (older
        verified steps stay in the trust history but may lose their shards)."""
        if self.ledger is None:
            return set()
        steps = set(self.ledger.verified_steps()[:1])
        if self.ledger.candidate_step is not None:
            steps.add(self.ledger.candidate_step)
        return steps

    # ------------------------------------------------------------- step hooks

    def _capture_due(self) -> bool:
        return self.manager is not None and self.step_count % self.config.interval == 0

    def _before_optimizer_step(self) -> None:
        self._finish_pending_capture()
        if self.scout is not None:
            try:
                result = self.scout.before_optimizer_step(self.step_count + 1)
            except ReplayError as exc:
                # Raised on every peer alike: SCOUT's own failure, not evidence about a device. The
                # boundary is captured uncertified ("error"); training goes on.
                logger.error("SCOUT: replay check at step %d failed: %s", self.step_count + 1, exc)
                self.scout_check_errors += 1
                self._boundary_verdict = "error"
                result = None
            if result is not None:
                self.scout_check_errors += len(result.errors)
                self._note_replay_result(result)
        if self.manager is not None:
            self.manager.maybe_wait()

    def _after_optimizer_step(self) -> None:
        with self._lock:
            self.step_count += 1
            if self._guard is not None:
                self._disarm_guard()  # training went on from the recovered state: later loads are the loop's own
            if self.scout is not None:
                self._note_local_fault(self.scout.after_optimizer_step(self.step_count))
            if not self._capture_due():
                return
            nonfinite = self._nonfinite_state() if self.config.check_finite else []
            checked = nonfinite is not None
            nonfinite = nonfinite or []
            if self.ledger is not None and self.scout is not None:  # a ledger is only built with SCOUT
                # SCOUT runs first: an SDC anywhere in the job vetoes this capture on every rank, and
                # so does NaN/Inf state anywhere (replay cannot see it once the all-reduce spread it).
                decision = self.ledger.boundary(self.step_count, self._boundary_verdict,
                                                cycle_complete=self.scout.cycle_complete(self.step_count),
                                                finite=not nonfinite)
                self._boundary_verdict = "incomplete"
                if decision.nonfinite_ranks:
                    self._refuse_nonfinite(list(decision.nonfinite_ranks), nonfinite)
                if not decision.capture:
                    logger.warning("lm-resiliency: capture of step %d vetoed: %s", self.step_count, decision.reason)
                    self.activity.record("vetoed", step=self.step_count, reason=decision.reason)
                    return
            elif nonfinite:
                self._refuse_nonfinite([dist.get_rank() if dist.is_initialized() else 0], nonfinite)
            self._pending = {"step": self.step_count, "rng": capture_rng(), "checked": checked}

    def _refuse_nonfinite(self, ranks: list, local: list) -> None:
        message = (f"lm-resiliency: step {self.step_count} is not captured or certified: non-finite parameters "
                   f"or optimizer state on ranks {ranks}" + (f" (here: {', '.join(local[:8])})" if local else "")
                   + ". Restart to recover the newest finite capture, or set "
                   "InMemoryCkptConfig.check_finite=False if such values are intended.")
        logger.error(message)
        raise NonFiniteState(message)

    def _nonfinite_state(self) -> Optional[list]:
        """Names of the model's parameters and the optimizer's state (its state tensors and
        values, and every hyperparameter of its param groups, e.g. a NaN `lr`) that hold NaN or
        Inf (local shards of distributed tensors); None when the adapter exposes no module (then
        the manager checks the whole capture). Buffers and framework metric state may hold
        intended infinities (a -inf mask, EarlyStopping's initial best score) and are not checked."""
        try:
            model, optimizer = self.adapter.replay_targets()
        except NotImplementedError:
            return None
        named = list(model.named_parameters())
        values = []  # everything else the optimizer's state_dict() holds, small
        for index, state in enumerate(getattr(optimizer, "state", {}).values()):
            for key, value in state.items():
                where = f"optimizer.state[{index}][{key!r}]"
                if isinstance(value, torch.Tensor):  # checked together: one synchronization
                    named.append((where, value))
                else:
                    values.append((where, value))
        for index, group in enumerate(getattr(optimizer, "param_groups", [])):
            values += [(f"optimizer.param_groups[{index}][{key!r}]", value) for key, value in group.items()
                       if key != "params"]
        tensors = [t.to_local() if type(t).__name__ == "DTensor" else t for _, t in named]
        return ([named[i][0] for i in nonfinite_indices([t.detach() for t in tensors])]
                + nonfinite_values(values))

    def _skipped_optimizer_step(self) -> None:
        """A step boundary whose optimizer.step() was skipped (a GradScaler found inf/NaN gradients).
        It counts, so `step_count` keeps matching the loop's counter; the parameters did not change,
        so nothing is captured (the next capture is at the next multiple of `interval`). Every rank
        skips alike because the gradients were all-reduced before the scaler checked them."""
        with self._lock:
            self.step_count += 1
            if self._guard is not None:
                self._disarm_guard()
            if self.scout is not None:
                self._note_local_fault(self.scout.after_optimizer_step(self.step_count, skipped=True))

    def _before_forward(self) -> None:
        if self._pending is not None:
            self._finish_pending_capture()
        if self.scout is not None:
            self.scout.before_forward(self.step_count + 1)

    def _note_replay_result(self, result: ReplayResult) -> None:
        self.last_replay_result = result
        # The verdict a capture boundary sees is the worst since the previous boundary
        # ("incomplete" until the first result).
        verdict = verdict_of(result)
        self.activity.verdict(verdict)
        self._boundary_verdict = (verdict if self._boundary_verdict == "incomplete"
                                  else worst(verdict, self._boundary_verdict))
        if result.healthy:
            return
        for report in replay_fault_reports(result):
            self.activity.report(report)
        if self._fault_callback is not None:
            self._fault_callback(result)
        if self._orchestration is not None:
            dispatch_replay_faults(result, self._orchestration,
                                   topology=self.manager.topology if self.manager else None,
                                   step_source=self._local_checkpoint)

    def _note_local_fault(self, report: Optional[SCOUTFaultReport]) -> None:
        """A fault this rank found on its own (non-finite gradients before the all-reduce): the
        interval is not certified (the capture boundary agrees on the worst verdict of any rank)."""
        if report is None:
            return
        self._boundary_verdict = "sdc"
        self._on_oob_report(report)

    def _local_checkpoint(self, mode: RecoveryMode) -> tuple:
        """Rank-local, non-collective: the checkpoint a restart in `mode` would use."""
        if self.manager is None:
            return None, None
        if mode is RecoveryMode.RECOVERY_VERIFIED:
            verified = self.ledger.verified_steps() if self.ledger is not None else []
            return (verified[0], "node_local") if verified else (None, None)
        if self.manager.latest_step >= 0:
            return self.manager.latest_step, "memory"
        disk = [k.step for k in self.manager.node_store().list_shards() if k.kind == "own"]
        return (max(disk), "node_local") if disk else (None, None)

    def _on_oob_report(self, report: SCOUTFaultReport) -> None:
        """Runs on the monitor thread: never touches the (possibly blocked) training process group."""
        self.activity.report(report)
        decision = self._decide(report.kind if report.kind != "hang" else "hang", all_ranks_accessible=True)
        hooks = self._orchestration
        if hooks is not None and hooks.report_recovery is not None:
            hooks.report_recovery(decision)
        if hooks is not None and hooks.report_fault is not None:
            hooks.report_fault(report)
        if self._oob_fault_callback is not None:
            self._oob_fault_callback(report)

    def _finish_pending_capture(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None or self.manager is None:
                return
            extra = check_extra_state(self._extra_state_fn() if self._extra_state_fn else None)
            state = {"framework": self.adapter.framework_state(), "deferred": self.adapter.deferred_state(),
                     "rng": pending["rng"], "extra": extra, "step": pending["step"]}
            # Parameters and optimizer state were checked at the boundary (`_nonfinite_state`).
            self.manager.save(state, pending["step"], check_finite=False if pending["checked"] else None)
            self.activity.captured(pending["step"], self.manager)

    def summary(self) -> Dict[str, Any]:
        """What this session did (this rank's view; JSON-ready): optimizer steps, captures, the
        newest recoverable and RECOVERY_VERIFIED steps, SCOUT checks by verdict, and the seconds
        the training thread spent in lm-resiliency's hooks out of the session's wall time."""
        return self.activity.summary(
            step=self.step_count, newest_recoverable=self.latest_gemini_step,
            verified=self.ledger.recovery_verified_step if self.ledger is not None else None,
            check_errors=self.scout_check_errors)

    # ------------------------------------------------- what framework surfaces read

    @property
    def latest_gemini_step(self) -> int:
        """The newest step GEMINI holds a capture of (-1: none yet, or GEMINI is off)."""
        return self.manager.latest_step if self.manager is not None else -1

    def capture_due(self) -> bool:
        """Whether the step just counted is a GEMINI capture boundary."""
        return self._capture_due()

    def keep_state_for_relaunch(self) -> None:
        """The surface is ending this launch abnormally: `close()` keeps GEMINI's shared-memory
        slots (possibly the only copy of the newest capture) for the relaunch."""
        if self.manager is not None:
            self.manager.keep_shared_on_close()

    def continue_from(self, step: int) -> None:
        """Count on from `step`: the framework restored its own step counter (its checkpoint was
        loaded instead of GEMINI state), and `step_count` follows it."""
        with self._lock:
            self.step_count = int(step)

    # -------------------------------------------------------------- lifecycle

    def instrument_dataloader(self, dataloader: Any, name: str = "train") -> Any:
        """Wrap `dataloader` so SCOUT's out-of-band monitor sees stalled `next()` calls. Instrument it
        before creating its long-lived iterator. Returned unchanged when SCOUT is disabled."""
        if self.scout is None:
            return dataloader
        return self.scout.instrument_dataloader(dataloader, name)

    @contextlib.contextmanager
    def checkpoint_io(self, kind: str, name: str = "checkpoint") -> Iterator[None]:
        """Marks a framework checkpoint read or write (for out-of-band stall localization)."""
        if kind not in ("read", "write"):
            raise ValueError(f"checkpoint_io(kind=...): expected 'read' or 'write', got {kind!r}")
        if self.scout is None:
            yield
            return
        with self.scout.checkpoint_io(kind, name):
            yield

    def flush_for_restart(self) -> int:
        """Complete any pending capture and write the newest recoverable state to node-local disk.
        Returns its step, or -1 when there is none."""
        if self.manager is None or self._closed:
            return -1
        self._finish_pending_capture()
        self.manager.maybe_wait()
        return self.manager.flush_now()

    def set_restart_destination(self, resolver: Optional[Callable[[], Optional[str]]]) -> None:
        if resolver is not None and not callable(resolver):
            raise TypeError("set_restart_destination expects a callable returning a directory (or None)")
        self._restart_destination = resolver

    def copy_checkpoint_to(self, destination: Optional[str] = None) -> list:
        """Copy this rank's flushed shards (own and held peer replicas, plus the status sidecar)
        to `destination`, keeping the run/rank layout. Each file is published atomically."""
        if destination is None and self._restart_destination is not None:
            destination = self._restart_destination()
        if destination is None:
            raise ValueError("copy_checkpoint_to: no destination given and no restart destination resolver set")
        if self.manager is None:
            return []
        source_dir = self.manager.node_store().directory
        target_dir = destination
        for part in os.path.relpath(source_dir, self.manager.config.disk_folder).split(os.sep):
            target_dir = os.path.join(target_dir, part)
            ensure_private_dir(target_dir, "checkpoint copy directory")  # the run/rank layout, 0700
        copied = []
        for name in sorted(os.listdir(source_dir)):
            if name.startswith(".") or name in (EVENT_FILE, OLD_EVENT_FILE):  # the log describes this node's run
                continue
            source = os.path.join(source_dir, name)
            if name.startswith(".") or os.path.islink(source) or not os.path.isfile(source):
                continue
            fd = open_owned(source, "GEMINI file", RecordRejected)  # the checks again, on the open file
            if fd is None:
                continue
            with os.fdopen(fd, "rb") as f:
                atomic_write(os.path.join(target_dir, name), lambda out: shutil.copyfileobj(f, out))
            copied.append(os.path.join(target_dir, name))
        return copied

    def prepare_recovery(self, failure: str, all_ranks_accessible: bool = True) -> RecoveryMode:
        """Select latest or recovery-verified trust for `failure` and return it (the
        ``recovery_mode=`` a relaunch passes); hand the decision (that mode, this rank's checkpoint
        for it, the reason) to orchestration (`report_recovery`) and keep it as
        `last_recovery_decision`.

        A hang or uncertain failure with every rank accessible first runs SCOUT's full-catalog
        replay sweep (scout/sweep.py): collective among the peers that call it, so call it on every
        rank; it talks over the c10d store, never the training process group, and gives up on
        peers after `ReplayHarnessConfig.full_sweep_timeout_s`. Only a complete clean sweep selects
        LATEST. SDC found by the sweep is handled like any SDC: verified-only recovery is latched
        in the certification ledger (persisted), then `fault_callback`, the decision and the fault
        reports (`report_fault`) follow, as for a replay fault. Every other case is rank-local and
        sends nothing to other ranks."""
        failure_class = FailureClass.parse(failure)
        sweep = None
        if all_ranks_accessible and failure_class in (FailureClass.HANG, FailureClass.UNCERTAIN):
            sweep = self._full_sweep()
            if sweep.outcome is SweepOutcome.SDC and self.ledger is not None:
                self.ledger.note_sdc(self.step_count, sweep.reason)
        decision = self._decide(failure, all_ranks_accessible, sweep)
        fault = sweep.result if sweep is not None and sweep.result is not None and not sweep.result.healthy else None
        if fault is not None:
            self.last_replay_result = fault
            if self._fault_callback is not None:
                self._fault_callback(fault)
        hooks = self._orchestration
        if hooks is not None and hooks.report_recovery is not None:
            hooks.report_recovery(decision)
        if fault is not None and hooks is not None and hooks.report_fault is not None:
            for report in replay_fault_reports(fault):
                hooks.report_fault(report)
        return decision.recovery_mode

    def _full_sweep(self) -> SweepReport:
        if self.scout is None:
            return SweepReport(SweepOutcome.NOT_RUN, "SCOUT is disabled (enable_detection=False)")
        if self.scout.sweep is None:
            return SweepReport(SweepOutcome.NOT_RUN, "SCOUT replay is off for this model (see the warning logged "
                                                     "when the session started)")
        return self.scout.sweep.run(self.step_count)

    def _decide(self, failure: str, all_ranks_accessible: bool,
                sweep: Optional[SweepReport] = None) -> RecoveryDecision:
        mode, reason = select_mode(failure, all_ranks_accessible=all_ranks_accessible,
                                   sweep=sweep.outcome if sweep is not None else SweepOutcome.NOT_RUN)
        if sweep is not None:
            reason = f"{reason} ({sweep.reason})"
        step, source = self._local_checkpoint(mode)
        decision = recovery_decision(failure, mode, reason, step=step, source=source,
                                     topology=self.manager.topology if self.manager else None)
        self.last_recovery_decision = decision
        return decision

    def close(self) -> None:
        """Complete the pending capture, stop background work, remove hooks. Idempotent; also runs
        at interpreter exit.

        If the last capture or its flush failed (e.g. the node-local disk is full or read-only),
        the error is raised here once teardown is complete, so a run never ends as if its final
        state were saved; the error names the file."""
        if self._closed:
            return
        self._closed = True
        failure: Optional[Exception] = None
        try:
            if self.manager is not None and dist.is_initialized() == (self.manager.world_size > 1):
                self._finish_pending_capture()
                self.manager.maybe_wait()
        except Exception as exc:  # noqa: BLE001 - teardown must continue; raised at the end
            failure = exc
        finally:
            self._disarm_guard()
            self._close_report()
            self.adapter.remove()
            if self.scout is not None:
                self.scout.close()
            if self.manager is not None:
                try:
                    self.manager.close()
                except Exception as exc:  # noqa: BLE001 - raised at the end, after the groups
                    if failure is not None:
                        logger.error("lm-resiliency: closing GEMINI also failed: %s", exc)
                    failure = failure or exc
            if self._agreement_group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(self._agreement_group)
                except (RuntimeError, ValueError) as exc:
                    logger.debug("lm-resiliency: agreement group already gone: %s", exc)
            self._agreement_group = None
        if failure is not None:
            raise failure

    def _close_report(self) -> None:
        """The `close` event and rank 0's summary line (INFO); never fails the teardown."""
        try:
            summary = self.summary()
        except Exception as exc:  # noqa: BLE001 - a summary must never hide the teardown's own error
            logger.debug("lm-resiliency: no close summary: %s", exc)
            return
        self.activity.closed(summary, run_name=self._run_name(), detection=self.scout is not None,
                             rank=dist.get_rank() if dist.is_initialized() else 0,
                             abnormal=self.manager is not None and self.manager.ending_abnormally)


def _check_cadence(capture_interval: int, replay: ReplayHarnessConfig) -> None:
    """Every capture boundary needs an accepted SCOUT check at that step (GEMINI guide,
    "Checkpoint Validation"), so some check class must run at every capture step."""
    classes = [c for c in CHECK_CLASSES if replay.interval_for(c) > 0]   # a class at 0 is off
    if not any(capture_interval % replay.interval_for(c) == 0 for c in classes):
        intervals = {c: replay.interval_for(c) for c in CHECK_CLASSES}
        raise ValueError(
            f"InMemoryCkptConfig.interval={capture_interval} is not a multiple of any SCOUT check interval "
            f"{intervals}; captures would never have an accepted check at their step and would all be vetoed. "
            "Use the shared enable_resiliency(interval=...) or align ReplayHarnessConfig.*_check_interval.")


def _as_hooks(orchestration: Any) -> Optional[OrchestrationHooks]:
    """Accept OrchestrationHooks or any object with the same (optional) callables."""
    if orchestration is None or isinstance(orchestration, OrchestrationHooks):
        return orchestration
    return OrchestrationHooks(report_fault=getattr(orchestration, "report_fault", None),
                              report_recovery=getattr(orchestration, "report_recovery", None),
                              restart_destination=getattr(orchestration, "restart_destination", None))


def _close_at_exit(ref: "weakref.ReferenceType") -> None:
    session = ref()
    if session is not None:
        try:
            session.close()
        except Exception:  # nobody is left to raise it to
            logger.exception("lm-resiliency: close() at interpreter exit failed; the last capture or "
                             "flush may be missing")
