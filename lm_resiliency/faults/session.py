"""FaultInjectionSession: binds a campaign to a model and optimizer with hooks only.

The optimizer post-step hook is the iteration boundary: it advances the `training_iteration`
clock and arms the occurrences due in the new iteration. Armed faults then meet their matching
calls through hooks: module forward (pre-)hooks, optimizer pre/post-step hooks, the root
module's first forward of each iteration, and batches of a wrapped data loader. An occurrence is
claimed in the campaign state store right before its first fault is performed, so a worker that
stops between arming and the matching call leaves it to its successor. Every execution becomes a
`FaultInjectionRecord` in the campaign journal. The training loop is not changed.

Why one module of this size: the injection session's hooks, activation rules and records share
one per-iteration state.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from lm_resiliency.config import ConfigError, env_resume_step
from lm_resiliency.files import ensure_private_dir

from .campaign import FaultCampaign, FaultIncident, FaultSpec
from .corruption import derive_seed
from .errors import CampaignIdentityError, InjectedFault, UnsupportedFaultError
from .executor import UNCHANGED, FaultExecutionRequest, FaultExecutor
from .journal import CampaignJournal
from .local_executor import LocalFaultExecutor
from .binding import bind, resolve_modules
from .records import FaultInjectionRecord, InjectionStatus
from .schedule import ClockOrigin, ClockType, RetriggerPolicy
from .scoring import CampaignReport, LocalizationResult, evaluate
from .state import CampaignStateStore, MemoryCampaignStateStore, claim
from .state import setdefault as state_setdefault
from .taxonomy import FailureType, FaultSurface, SafetyClass

logger = logging.getLogger(__name__)

GENERATION_ENV = "TORCHELASTIC_RESTART_COUNT"
WALL_CLOCK_ORIGIN_KEY = "wall_clock_origin"
MANIFEST_KEY = "campaign_manifest"

U = FaultSurface
# Faults that meet their matching call at the first forward of each iteration.
_ITERATION_START_SURFACES = frozenset({U.PROCESS, U.CHECKPOINT, U.COLLECTIVE, U.NETWORK, U.STORAGE,
                                       U.DEVICE, U.CONFIG})
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(eq=False)
class _Activation:
    """One armed occurrence of an incident on this rank."""

    incident: FaultIncident
    occurrence_id: str
    tick: int
    armed_iteration: int
    faults: Tuple[FaultSpec, ...]
    claim_key: str
    claimed: Optional[bool] = None  # None: not yet tried; False: another worker of this rank has it
    calls: Dict[str, int] = field(default_factory=dict)
    contexts: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    dead: set = field(default_factory=set)  # fault ids that must not run again (unsupported)
    staged: set = field(default_factory=set)  # stale-state faults waiting for their post-step
    started: set = field(default_factory=set)  # fault ids the executor ran: deactivated when it ends

    def live(self, spec: FaultSpec, iteration: int) -> bool:
        if spec.fault_id in self.dead:
            return False
        lifetime = self.incident.lifetime
        if lifetime.iterations is not None and iteration >= self.armed_iteration + lifetime.iterations:
            return False
        return self.calls.get(spec.fault_id, 0) < lifetime.call_limit

    def any_live(self, iteration: int) -> bool:
        return any(self.live(spec, iteration) for spec in self.faults)


def _default_rank_and_world() -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class FaultInjectionSession:
    """An attached campaign (see `enable_fault_injection`). Close it to remove every hook."""

    def __init__(self, model: Any, optimizer: Any, campaign: FaultCampaign, *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, executor: Optional[FaultExecutor] = None,
                 state_store: Optional[CampaignStateStore] = None,
                 journal: Optional[CampaignJournal] = None, start_iteration: Optional[int] = None,
                 generation: Optional[str] = None, sandbox_dir: Optional[str] = None,
                 strict: bool = True) -> None:
        binding = bind(model, optimizer)
        if not isinstance(campaign, FaultCampaign):
            raise TypeError(f"enable_fault_injection: campaign must be a FaultCampaign, got "
                            f"{type(campaign).__name__}")
        default_rank, default_world = _default_rank_and_world()
        self._rank = default_rank if rank is None else rank
        self._world_size = default_world if world_size is None else world_size
        if not isinstance(self._rank, int) or self._rank < 0:
            raise ValueError(f"enable_fault_injection: rank must be a non-negative int, got {self._rank!r}")
        if not isinstance(self._world_size, int) or self._world_size <= self._rank:
            raise ValueError(f"enable_fault_injection: world_size must be an int greater than rank "
                             f"{self._rank}, got {self._world_size!r}")
        if start_iteration is None:
            try:
                start_iteration = binding.start if binding.start is not None else env_resume_step() or 0
            except ConfigError as exc:
                raise ConfigError(f"enable_fault_injection: {exc}") from None
        if not isinstance(start_iteration, int) or start_iteration < 0:
            raise ValueError(f"enable_fault_injection: start_iteration must be a non-negative int (the "
                             f"number of optimizer steps already completed), got {start_iteration!r}")
        if executor is not None and not callable(getattr(executor, "execute", None)):
            raise TypeError(f"enable_fault_injection: executor must be a FaultExecutor, "
                            f"got {type(executor).__name__}")
        if state_store is not None and not callable(getattr(state_store, "compare_and_swap", None)):
            raise TypeError(f"enable_fault_injection: state_store must be a CampaignStateStore with "
                            f"compare_and_swap, got {type(state_store).__name__}")
        if journal is not None and not callable(getattr(journal, "append", None)):
            raise TypeError(f"enable_fault_injection: journal must be a CampaignJournal, "
                            f"got {type(journal).__name__}")
        self.model = model
        self.binding = binding
        # What executors see: one module over every model part, and the optimizer faults read.
        self._root = binding.parts[0] if len(binding.parts) == 1 else torch.nn.ModuleList(binding.parts)
        self.optimizer = binding.optimizer
        self.campaign = campaign
        self.executor = executor if executor is not None else LocalFaultExecutor()
        self.state_store = state_store if state_store is not None else MemoryCampaignStateStore()
        self.journal = journal if journal is not None else CampaignJournal()
        self.generation = str(generation if generation is not None
                              else os.environ.get(GENERATION_ENV, f"pid-{os.getpid()}"))
        self.strict = bool(strict)
        self._digest = campaign.digest
        self._bind_manifest()
        self._start_iteration = start_iteration
        self._iteration = start_iteration + 1
        self._host = socket.gethostname()
        self._records: List[FaultInjectionRecord] = []
        self._activations: Dict[str, _Activation] = {}
        self._handles: list = []
        self._closed = False
        self._pending_start = True
        self._sandbox_root = sandbox_dir
        self._own_sandbox = False

        self._incidents: List[Tuple[FaultIncident, Tuple[FaultSpec, ...]]] = []
        self._unsupported: Dict[str, str] = {}
        self._modules: Dict[str, torch.nn.Module] = {}
        self._hooked: Dict[str, Tuple[torch.nn.Module, ...]] = {}
        for incident in campaign.incidents:
            mine = tuple(f for f in incident.faults if f.target.rank == self._rank)
            if not mine:
                continue
            self._incidents.append((incident, mine))
            for spec in mine:
                try:
                    self._resolve(incident, spec)
                    check = getattr(self.executor, "check", None)
                    if check is not None:
                        check(spec)
                except UnsupportedFaultError as exc:
                    if self.strict:
                        raise
                    self._unsupported[spec.fault_id] = exc.reason
                    logger.warning("%s (it will be recorded as unsupported)", exc)
        self._wall_origin: Optional[float] = None
        self._last_wall_tick = -1
        if campaign.clock.type is ClockType.WALL_CLOCK:
            now = time.time()
            self._wall_origin = (float(state_setdefault(self.state_store, WALL_CLOCK_ORIGIN_KEY, now))
                                 if campaign.clock.origin is ClockOrigin.RUN_START else now)
        try:
            self._install_hooks()
            self._arm()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def iteration(self) -> int:
        """The training iteration now running (1-based; completed optimizer steps + 1)."""
        return self._iteration

    @property
    def records(self) -> Tuple[FaultInjectionRecord, ...]:
        """Records this session wrote (the journal may hold other ranks' and generations' too)."""
        return tuple(self._records)

    @property
    def active_occurrences(self) -> Tuple[str, ...]:
        return tuple(a.occurrence_id for a in self._activations.values() if a.any_live(self._iteration))

    def advance(self) -> None:
        """Mark an iteration boundary by hand (only when the session was given no optimizer; the
        framework's step calls this for you)."""
        if self._closed:
            return
        self._finish_stale_state()
        self._iteration += 1
        self._expire()
        self._arm()
        self._pending_start = True

    def set_iteration(self, completed_steps: int) -> None:
        """Re-align the clock after an in-process recovery restored `completed_steps`: armed
        occurrences are dropped (recorded as armed if they never ran, so a replayed tick arms
        them again) and the next iteration's occurrences are armed; restart-stable ids and
        claims make replayed ones that already ran safe."""
        if not isinstance(completed_steps, int) or completed_steps < 0:
            raise ValueError(f"set_iteration: completed_steps must be a non-negative int, "
                             f"got {completed_steps!r}")
        for act in self._activations.values():
            if act.claimed is None:
                self._release(act)
            else:
                self._retire(act, "reset")
        self._activations.clear()
        self._iteration = completed_steps + 1
        self._arm()
        self._pending_start = True

    def wrap_dataloader(self, iterable: Iterable[Any]) -> "_FaultyLoader":
        """Route batches through the campaign's dataloader-surface faults (drop, duplicate,
        reorder, delay, hang, exception, io_error). Pass-through when none is armed."""
        return _FaultyLoader(self, iterable)

    def evaluate(self, localizations: Sequence[LocalizationResult] = (), *,
                 world_size: Optional[int] = None,
                 window_iterations: Optional[int] = None) -> CampaignReport:
        """Score `localizations` against the ground truth in the journal (every rank and
        generation that shares it). See `lm_resiliency.faults.evaluate`."""
        return evaluate(self.journal.records(), localizations, campaign=self.campaign,
                        world_size=world_size or self._world_size, window_iterations=window_iterations)

    def close(self) -> None:
        """Remove every hook, release held resources and the session's own sandbox. Idempotent.
        Occurrences armed but not yet performed are recorded as armed and left unclaimed."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        try:
            for act in self._activations.values():
                if act.claimed is None:
                    self._release(act)
                else:
                    self._deactivate(act, "closed")
        finally:
            self._activations.clear()
        if self._own_sandbox and self._sandbox_root is not None:
            shutil.rmtree(self._sandbox_root, ignore_errors=True)

    def __enter__(self) -> "FaultInjectionSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"FaultInjectionSession(campaign={self.campaign.name!r}, rank={self._rank}, "
                f"iteration={self._iteration}, active={list(self.active_occurrences)})")

    # ------------------------------------------------------------------ targets

    def _resolve(self, incident: FaultIncident, spec: FaultSpec) -> None:
        """Find the modules `spec` targets and refuse what cannot be scheduled: a `matching_calls`
        lifetime over several candidate modules (whose calls would it count?) and a gradient fault
        on parameters that are all frozen (they never get one)."""
        path = spec.target.module_path
        if path is None:
            candidates = [("", self._root)]
        else:
            candidates = resolve_modules(self.binding.parts, path, spec.fault_id)
        names = [name or "(the model)" for name, _ in candidates]
        if len(candidates) > 1 and incident.lifetime.matching_calls is not None:
            raise UnsupportedFaultError(spec.fault_id, f"module_path {path!r} names {len(candidates)} candidates "
                                                       f"({', '.join(names)}) and a matching_calls lifetime counts "
                                                       f"the calls of one: name one of them (a model part is "
                                                       f"prefixed by its index) or give an iterations or permanent "
                                                       f"lifetime")
        unique = tuple({id(m): m for _, m in candidates}.values())
        self._hooked[spec.fault_id] = unique
        if path is not None:
            # Several candidates: the state faults see them as one module (parts "0", "1", ...).
            self._modules[spec.fault_id] = unique[0] if len(unique) == 1 else torch.nn.ModuleList(unique)
        if spec.target.surface is U.GRADIENT:
            wanted = spec.parameters.get("parameter")
            scope = self._modules.get(spec.fault_id, self._root)
            targeted = [(n, p) for n, p in scope.named_parameters() if wanted is None or n == wanted]
            if targeted and not any(p.requires_grad for _, p in targeted):
                raise UnsupportedFaultError(spec.fault_id, f"every parameter it targets in {', '.join(names)} "
                                                           f"({', '.join(n for n, _ in targeted[:8])}) is frozen "
                                                           f"(requires_grad=False), so it never has a gradient; "
                                                           f"target a trainable parameter")

    # ------------------------------------------------------------------ manifest identity

    def _bind_manifest(self) -> None:
        """Bind the state store (and check the journal) to this manifest. A store or journal of
        another manifest under the same name would mark its faults `already_claimed` (never
        injected) and mix its records into this ground truth: refused."""
        mine = {"name": self.campaign.name, "digest": self._digest}
        fix = ("Give the changed manifest a new state store and journal (or a new name), or restore the "
               "manifest they were started with.")
        state = self.state_store.load()
        if MANIFEST_KEY not in state.get("values", {}) and state.get("claims"):
            raise CampaignIdentityError(
                f"enable_fault_injection: campaign state store {self.state_store!r} holds claims "
                f"{sorted(state['claims'])[:4]} but no record of the manifest that made them (an older release "
                f"or a hand-written state); they cannot be matched to campaign {self.campaign.name!r} "
                f"({self._digest}). {fix}")
        bound = state_setdefault(self.state_store, MANIFEST_KEY, mine)
        if bound != mine:
            raise CampaignIdentityError(
                f"enable_fault_injection: campaign state store {self.state_store!r} belongs to campaign "
                f"{bound.get('name')!r} with manifest {bound.get('digest')}, not campaign {self.campaign.name!r} "
                f"with manifest {self._digest}: the manifest changed under its name, and its claims would "
                f"record the changed faults as already_claimed and never inject them. {fix}")
        foreign = sorted({r.campaign_digest or "(none recorded)" for r in self.journal.records()
                          if r.campaign_digest != self._digest})
        if foreign:
            raise CampaignIdentityError(
                f"enable_fault_injection: campaign journal {self.journal!r} holds records of manifest(s) "
                f"{foreign}, not of campaign {self.campaign.name!r} ({self._digest}); scoring would mix their "
                f"ground truth with this one's. {fix}")

    # ------------------------------------------------------------------ hooks

    def _install_hooks(self) -> None:
        for part in self.binding.parts:
            self._handles.append(part.register_forward_pre_hook(self._on_root_forward, prepend=True))
        outputs: Dict[int, torch.nn.Module] = {}
        inputs: Dict[int, torch.nn.Module] = {}
        for _, specs in self._incidents:
            for spec in specs:
                for module in self._hooked.get(spec.fault_id, ()):
                    if spec.target.surface is U.OUTPUT:
                        outputs[id(module)] = module
                    elif spec.target.surface is U.INPUT:
                        inputs[id(module)] = module
        for module in outputs.values():
            self._handles.append(module.register_forward_hook(self._on_output))
        for module in inputs.values():
            self._handles.append(module.register_forward_pre_hook(self._on_input))
        if self.binding.clock is not None:
            remove = self.binding.clock.install(self._on_pre_step, self.advance, self._on_skipped_step)
            self._handles.append(_Removal(remove))

    def _live(self, predicate) -> List[Tuple[_Activation, FaultSpec]]:
        out = []
        for act in list(self._activations.values()):
            for spec in act.faults:
                if predicate(spec) and act.live(spec, self._iteration):
                    out.append((act, spec))
        return out

    def _on_root_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if self._closed or not self._pending_start:
            return None
        running = self.binding.clock.iteration() if self.binding.clock is not None else None
        if running is not None and running != self._iteration:
            # The framework's own counter moved (a checkpoint it loaded): the clock follows it.
            logger.info("fault campaign %s: the %s step says iteration %d, not %d; following it",
                        self.campaign.name, self.binding.framework, running, self._iteration)
            self.set_iteration(running - 1)
        self._pending_start = False
        for act, spec in self._live(self._starts_iteration):
            self._run(act, spec, "iteration_start", module=self._modules.get(spec.fault_id))
        return None

    @staticmethod
    def _starts_iteration(spec: FaultSpec) -> bool:
        surface = spec.target.surface
        return surface in _ITERATION_START_SURFACES or (
            spec.type is FailureType.TENSOR_CORRUPTION and surface in (U.PARAMETER, U.OPTIMIZER_STATE))

    def _on_output(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if self._closed:
            return None
        changed = False
        for act, spec in self._live(lambda s: s.target.surface is U.OUTPUT
                                    and module in self._hooked.get(s.fault_id, ())):
            value = self._run(act, spec, "forward", value=output, module=module)
            if value is not UNCHANGED:
                output, changed = value, True
        return output if changed else None

    def _on_input(self, module: torch.nn.Module, args: tuple) -> Any:
        if self._closed:
            return None
        changed = False
        for act, spec in self._live(lambda s: s.target.surface is U.INPUT
                                    and module in self._hooked.get(s.fault_id, ())):
            value = self._run(act, spec, "forward_pre", value=args, module=module)
            if value is not UNCHANGED:
                args, changed = tuple(value), True
        return args if changed else None

    def _on_pre_step(self) -> None:
        if self._closed:
            return None
        for act, spec in self._live(lambda s: s.type is FailureType.STALE_STATE or (
                s.type is FailureType.TENSOR_CORRUPTION and s.target.surface is U.GRADIENT)):
            self._run(act, spec, "pre_step", module=self._modules.get(spec.fault_id))
            if spec.type is FailureType.STALE_STATE:
                act.staged.add(spec.fault_id)
        return None

    def _on_skipped_step(self) -> None:
        """The framework skipped the update (an overflow): the iteration runs again, uncounted."""
        if not self._closed:
            self._finish_stale_state()

    def _finish_stale_state(self) -> None:
        for act in list(self._activations.values()):
            for spec in act.faults:
                if spec.fault_id in act.staged:
                    act.staged.discard(spec.fault_id)
                    self._run(act, spec, "post_step", module=self._modules.get(spec.fault_id), count=False)

    def _batch_faults(self) -> List[Tuple[_Activation, FaultSpec]]:
        return self._live(lambda s: s.target.surface is U.DATALOADER)

    # ------------------------------------------------------------------ arming

    def _ticks(self) -> List[int]:
        if self._wall_origin is None:
            if self.campaign.clock.origin is ClockOrigin.RUN_START:
                return [self._iteration]
            return [self._iteration - self._start_iteration]
        now = int(math.floor(time.time() - self._wall_origin))
        ticks = list(range(self._last_wall_tick + 1, now + 1))
        self._last_wall_tick = max(self._last_wall_tick, now)
        return ticks

    def _arm(self) -> None:
        ticks = self._ticks()
        seed = self.campaign.seed
        for incident, specs in self._incidents:
            tick = next((t for t in ticks if incident.trigger.fires(t, seed=seed,
                                                                     incident_id=incident.incident_id)), None)
            if tick is None:
                continue
            occurrence_id = f"{incident.incident_id}@{tick}"
            key = f"{occurrence_id}/rank-{self._rank}"
            if incident.retrigger is RetriggerPolicy.EVERY_GENERATION:
                key += f"/generation-{self.generation}"
            act = _Activation(incident, occurrence_id, tick, self._iteration, specs, key)
            if key in self.state_store.load().get("claims", {}):
                # Performed earlier (a replayed iteration): not armed at all. The claim itself
                # is taken only when a fault is about to run (`_claim`).
                self._record_already_claimed(act)
                continue
            previous = self._activations.pop(incident.incident_id, None)
            if previous is not None:
                self._retire(previous, "replaced")
            for spec in specs:
                if spec.fault_id in self._unsupported:
                    act.dead.add(spec.fault_id)
                    self._record(act, spec, InjectionStatus.UNSUPPORTED, 0, {},
                                 self._unsupported[spec.fault_id])
            self._activations[incident.incident_id] = act
            logger.info("fault campaign %s: armed %s on rank %d at iteration %d", self.campaign.name,
                        occurrence_id, self._rank, self._iteration)

    def _expire(self) -> None:
        for incident_id, act in list(self._activations.items()):
            if not act.any_live(self._iteration):
                del self._activations[incident_id]
                self._retire(act, "expired")

    def _release(self, act: _Activation) -> None:
        """Journal an occurrence dropped before any of its faults ran; it stays unclaimed."""
        for spec in act.faults:
            if spec.fault_id not in act.dead:
                self._record(act, spec, InjectionStatus.ARMED, 0, {"claim": act.claim_key},
                             "released before any matching call; not claimed")

    def _retire(self, act: _Activation, reason: str) -> None:
        for spec in act.faults:
            if act.calls.get(spec.fault_id, 0) == 0 and spec.fault_id not in act.dead:
                self._record(act, spec, InjectionStatus.EXPIRED, 0, {},
                             "the lifetime ended before any matching call")
        self._deactivate(act, reason)

    def _deactivate(self, act: _Activation, reason: str) -> None:
        """The occurrence ended (`reason`): the executor undoes what it started (a held or
        bounded state fault, a partition a custom executor opened), journaled as DEACTIVATED."""
        try:
            for spec in act.faults:
                if spec.fault_id not in act.started:
                    continue
                request = FaultExecutionRequest(
                    spec=spec, occurrence_id=act.occurrence_id, incident_id=act.incident.incident_id,
                    rank=self._rank, world_size=self._world_size, tick=act.tick, iteration=self._iteration,
                    call_index=act.calls.get(spec.fault_id, 0), seed=derive_seed(self.campaign.seed,
                                                                                 act.occurrence_id, spec.fault_id),
                    phase="deactivate", module=self._modules.get(spec.fault_id), model=self._root,
                    optimizer=self.optimizer, context=act.contexts.setdefault(spec.fault_id, {}), reason=reason)
                deactivate = getattr(self.executor, "deactivate", None)
                try:
                    result = deactivate(request) if deactivate is not None else None
                except Exception as exc:
                    self._record(act, spec, InjectionStatus.FAILED, request.call_index, {},
                                 f"deactivation ({reason}) failed: {type(exc).__name__}: {exc}")
                    logger.error("fault %s (%s): undoing its effect (%s) failed on rank %d: %s", act.occurrence_id,
                                 spec.fault_id, reason, self._rank, exc)
                    if self.strict:
                        raise
                    continue
                if result is not None:
                    self._record(act, spec, InjectionStatus.DEACTIVATED, request.call_index, result.evidence,
                                 result.detail or f"deactivated ({reason})")
        finally:
            act.started.clear()
            act.contexts.clear()

    # ------------------------------------------------------------------ execution

    def _sandbox(self, act: _Activation) -> str:
        if self._sandbox_root is None:
            self._sandbox_root = tempfile.mkdtemp(prefix=f"lmr-faults-rank{self._rank}-")
            self._own_sandbox = True
        path = os.path.join(self._sandbox_root, f"rank-{self._rank}",
                            _SAFE_NAME.sub("_", act.occurrence_id))
        ensure_private_dir(path, "fault sandbox directory")
        return path

    def _claim(self, act: _Activation) -> bool:
        """Claim `act`'s occurrence right before its first fault is performed. Exactly one of
        the workers of this rank that race here wins; the others stand the occurrence down."""
        if act.claimed is None:
            owner = {"rank": self._rank, "pid": os.getpid(), "host": self._host,
                     "generation": self.generation, "iteration": self._iteration, "time": time.time()}
            act.claimed = claim(self.state_store, act.claim_key, owner)
            if not act.claimed:
                self._record_already_claimed(act)
                act.dead.update(spec.fault_id for spec in act.faults)
        return act.claimed

    def _record_already_claimed(self, act: _Activation) -> None:
        for spec in act.faults:
            if spec.fault_id not in act.dead:
                self._record(act, spec, InjectionStatus.ALREADY_CLAIMED, 0, {"claim": act.claim_key},
                             "claimed earlier by another worker of this rank")

    def _run(self, act: _Activation, spec: FaultSpec, phase: str, *, value: Any = None,
             module: Any = None, fetch: Any = None, count: bool = True) -> Any:
        if not self._claim(act):
            return UNCHANGED
        if count:
            act.calls[spec.fault_id] = act.calls.get(spec.fault_id, 0) + 1
        call_index = act.calls.get(spec.fault_id, 0)
        context = act.contexts.setdefault(spec.fault_id, {})
        committed: Dict[str, bool] = {}

        def commit(evidence: Mapping[str, Any]) -> None:
            committed["done"] = True
            self._record(act, spec, InjectionStatus.INJECTED, call_index, evidence, "committed before effect")

        request = FaultExecutionRequest(
            spec=spec, occurrence_id=act.occurrence_id, incident_id=act.incident.incident_id,
            rank=self._rank, world_size=self._world_size, tick=act.tick, iteration=self._iteration,
            call_index=call_index, seed=derive_seed(self.campaign.seed, act.occurrence_id, spec.fault_id,
                                                    call_index),
            phase=phase, value=value, module=module, model=self._root, optimizer=self.optimizer,
            sandbox_dir=(self._sandbox(act) if spec.safety_class is SafetyClass.SANDBOXED_DESTRUCTIVE
                         else None),
            context=context, fetch=fetch, commit=commit)
        act.started.add(spec.fault_id)
        try:
            result = self.executor.execute(request)
        except UnsupportedFaultError as exc:
            act.dead.add(spec.fault_id)
            self._record(act, spec, InjectionStatus.UNSUPPORTED, call_index, {}, exc.reason)
            if self.strict:
                raise
            return UNCHANGED
        except InjectedFault as exc:
            if not committed:
                self._record(act, spec, InjectionStatus.INJECTED, call_index, exc.evidence,
                             f"{type(exc).__name__}: {exc}")
            raise
        except Exception as exc:
            self._record(act, spec, InjectionStatus.FAILED, call_index, {}, f"{type(exc).__name__}: {exc}")
            logger.error("fault %s (%s) failed on rank %d: %s", act.occurrence_id, spec.fault_id,
                         self._rank, exc)
            if self.strict:
                raise
            return UNCHANGED
        if result.status is not None and not committed:
            self._record(act, spec, result.status, call_index, result.evidence, result.detail)
        return result.value

    def _record(self, act: _Activation, spec: FaultSpec, status: InjectionStatus, call_index: int,
                evidence: Mapping[str, Any], detail: str) -> None:
        record = FaultInjectionRecord(
            occurrence_id=act.occurrence_id, incident_id=act.incident.incident_id,
            fault_id=spec.fault_id, failure_type=spec.type, rank=self._rank, status=status,
            tick=act.tick, iteration=self._iteration, wall_time=time.time(),
            surface=spec.target.surface, module_path=spec.target.module_path, call_index=call_index,
            world_size=self._world_size, generation=self.generation, host=self._host,
            pid=os.getpid(), evidence=dict(evidence), detail=detail, resource=spec.target.resource,
            component=spec.target.component, campaign_digest=self._digest)
        self._records.append(record)
        self.journal.append(record)
        if status is InjectionStatus.INJECTED:
            logger.info("injected %s (%s, %s) on rank %d at iteration %d", act.occurrence_id, spec.fault_id,
                        spec.type.value, self._rank, self._iteration)


class _Removal:
    """A handle that undoes a clock's installation, removed with the hooks."""

    def __init__(self, remove: Any) -> None:
        self.remove = remove


class _FaultyLoader:
    """Iterable wrapper returned by `FaultInjectionSession.wrap_dataloader`."""

    def __init__(self, session: FaultInjectionSession, iterable: Iterable[Any]) -> None:
        self._session = session
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._iterable, name)

    def __iter__(self) -> Iterator[Any]:
        session = self._session
        source = iter(self._iterable)
        while True:
            try:
                batch = next(source)
            except StopIteration:
                return
            armed = [] if session._closed else session._batch_faults()
            if not armed:
                yield batch
                continue
            act, spec = armed[0]
            value = session._run(act, spec, "batch", value=batch, fetch=lambda: next(source))
            if value is UNCHANGED:
                yield batch
            else:
                yield from value


def enable_fault_injection(model: Any, optimizer: Any = None, *,
                           campaign: FaultCampaign, rank: Optional[int] = None,
                           executor: Optional[FaultExecutor] = None,
                           state_store: Optional[CampaignStateStore] = None,
                           journal: Optional[CampaignJournal] = None,
                           world_size: Optional[int] = None, start_iteration: Optional[int] = None,
                           generation: Optional[str] = None, sandbox_dir: Optional[str] = None,
                           strict: bool = True) -> FaultInjectionSession:
    """Attach `campaign` to the training objects with hooks; returns the session.

    `model` is a `torch.nn.Module` with its `optimizer` (None: call `advance()` after each
    step), Megatron Core's model chunks (a list) with its `MegatronOptimizer`, a DeepSpeed engine
    alone, or a TorchTitan `Trainer` alone; the campaign clock follows that framework's own step
    (`lm_resiliency.faults.binding`). `rank`/`world_size` default to the default process group
    (or RANK/WORLD_SIZE, else 0/1). `executor` defaults to `LocalFaultExecutor()`;
    `state_store` to an in-process store (use `JsonCampaignStateStore` so restarted workers do
    not re-inject); `journal` to an in-memory one (use a path shared by the ranks to evaluate
    them together). `start_iteration` is the number of optimizer steps already completed
    (default: the framework's own counter, `engine.global_steps` or `trainer.step`, else
    $LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP or 0; for Megatron pass `args.iteration`).
    `generation` names this worker generation for EVERY_GENERATION incidents (default:
    $TORCHELASTIC_RESTART_COUNT, else this process). Destructive faults work in `sandbox_dir`
    (default: a temporary directory removed at close). With `strict` (default) a fault the
    executor cannot perform here fails at attach, and an executor error is raised; otherwise
    they are recorded as UNSUPPORTED / FAILED and training goes on.
    """
    return FaultInjectionSession(model, optimizer, campaign, rank=rank, world_size=world_size,
                                 executor=executor, state_store=state_store, journal=journal,
                                 start_iteration=start_iteration, generation=generation,
                                 sandbox_dir=sandbox_dir, strict=strict)


__all__ = ["FaultInjectionSession", "enable_fault_injection"]
