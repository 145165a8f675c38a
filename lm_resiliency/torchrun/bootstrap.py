"""The zero-import worker bootstrap (runs in every torchrun worker before its user module when
the rendezvous has `lm_resiliency_worker_config`).

1. Reads the agent's restart context and revalidates the policy digest agreed at rendezvous;
   publishes the selected step as LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP.
2. Installs one worker adapter: a custom `adapter = "package.module:factory"` at once; otherwise
   the native PyTorch one (tentative: every framework imports torch), replaced by the built-in
   adapter of the higher-level framework the worker imports (`WORKER_ADAPTERS`). Two higher-level
   frameworks fail the second import.
3. The adapter attaches at its framework's construction boundary and recovers exactly the
   selected step (or fails closed); see lm_resiliency/torchrun/workers/.
4. Refuses a second attach: with a built-in adapter, a session built by user code
   (`enable_resiliency()`, a framework callback or plugin) raises.
5. Records each completely captured step for the agent; closes the session when the default
   process group is destroyed (before it is), or at exit.
6. Ends the generation on SCOUT's verdicts the agents act on: SDC (every worker) and a hang (the
   one worker that reports it), see retirement.py.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.recovered_state import EarlyLoads, watch_environment_reads
from lm_resiliency.torchrun.context import POLICY_ENV
from lm_resiliency.torchrun.imports import HIGHER_LEVEL, watch_frameworks, when_imported
from lm_resiliency.torchrun.policy import WorkerPolicy
from lm_resiliency.torchrun.retirement import FaultWatch
from lm_resiliency.torchrun.worker_records import WorkerRecord, write_worker_record
from lm_resiliency.torchrun.worker import (BOOTSTRAP_ENV, CHECKPOINT_STEP_ENV, CONTEXT_READERS,
                                           TorchrunWorkerAdapterError, TorchrunWorkerContext, load_worker_context)
from lm_resiliency.torchrun.workers import (DeepSpeedWorkerAdapter, MegatronWorkerAdapter, NativePyTorchAdapter,
                                            TorchTitanWorkerAdapter)
from lm_resiliency.torchrun.workers.base import PREFIX, BuiltInWorkerAdapter, attaching, gather, load_policy

logger = logging.getLogger(__name__)

_DIST_MODULE = "torch.distributed.distributed_c10d"
_SESSION_MODULE = "lm_resiliency.session"

# The built-in adapter of each framework ("pytorch": tentative until a higher-level one is imported).
WORKER_ADAPTERS: Dict[str, Callable[[TorchrunWorkerContext, WorkerPolicy], BuiltInWorkerAdapter]] = {
    "pytorch": NativePyTorchAdapter, "deepspeed": DeepSpeedWorkerAdapter, "torchtitan": TorchTitanWorkerAdapter,
    "megatron": MegatronWorkerAdapter}


class WorkerBootstrap:
    """One worker process's automatic instrumentation."""

    def __init__(self, context: TorchrunWorkerContext, policy: WorkerPolicy) -> None:
        self.context = context
        self.policy = policy
        self.frameworks: List[str] = []
        self.adapter: Any = None
        self._recorded = (-1, -1)
        self._custom: Any = None
        self._directory = os.path.dirname(context.context_path)
        self._faults = FaultWatch(context.binding, self._directory, context.local_rank, context.local_world_size)
        self._early: Optional[EarlyLoads] = None

    @property
    def session(self) -> Any:
        """The attached session (None before the adapter attaches, and after close)."""
        return getattr(self.adapter, "session", None)

    # ----------------------------------------------------------------- imports

    def install(self) -> None:
        when_imported(_DIST_MODULE, self._patch_dist)
        if self.context.checkpoint_source == "gemini":
            self._watch_early_loads()
        if self.policy.adapter is not None:
            self._install_custom(self.policy.adapter)
        else:
            self._use("pytorch")
        if self.adapter is not None:  # a custom stack's own adapter may attach however it needs to
            when_imported(_SESSION_MODULE, self._guard_sessions)
        for name in watch_frameworks(self._note_framework):
            self._note_framework(name)

    def _use(self, framework: str) -> None:
        factory = WORKER_ADAPTERS[framework]
        if self.adapter is not None:
            self.adapter.deactivate(f"{HIGHER_LEVEL[framework]} was imported")
        adapter = factory(self.context, self.policy)
        self._watch(adapter)
        self.adapter = adapter
        adapter.install(self.context)

    def _watch(self, adapter: BuiltInWorkerAdapter) -> None:
        adapter.on_step, adapter.fault_callback = self._record, self._faults.on_replay_result
        adapter.oob_fault_callback = self._on_oob_report
        adapter.on_recovery_refused = self._record_refusal
        adapter.early_loads = self._early

    def _watch_early_loads(self) -> None:
        """This generation recovers GEMINI state: note the script's own loads before the attach,
        and whether it reads the step it must resume from (lm_resiliency.recovered_state)."""
        early = self._early = EarlyLoads(self.context.checkpoint_step, attaching)
        when_imported("torch.nn.modules.module", lambda module: early.watch_module_class(module.Module))
        when_imported("torch.optim.optimizer", lambda module: early.watch_optimizer_class(module.Optimizer))
        watch_environment_reads(CHECKPOINT_STEP_ENV, early.note_step_read)
        CONTEXT_READERS.append(early.note_step_read)

    def _on_oob_report(self, report: Any) -> None:
        """On the monitor thread: a hang SCOUT localized ends this process (retirement.py)."""
        self._faults.on_hang_report(report, self.session)

    def _note_framework(self, name: str) -> None:
        if name in self.frameworks:
            return
        self.frameworks.append(name)
        if len(self.frameworks) > 1:
            names = " and ".join(HIGHER_LEVEL[n] for n in self.frameworks)
            raise TorchrunWorkerAdapterError(
                f"{PREFIX}{names} are both imported; the worker adapter is chosen from the one higher-level "
                "framework a worker uses and is never picked arbitrarily. Import one, or set "
                "adapter = \"package.module:factory\" in the worker policy")
        if self._custom is None:
            self._use(name)

    def _install_custom(self, spec: str) -> None:
        module_name, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module_name), attr, None)
        if not callable(factory):
            raise TorchrunWorkerAdapterError(f"worker policy adapter {spec!r}: {attr} is not a callable factory")
        self._custom = factory(self.context)
        if not callable(getattr(self._custom, "install", None)):
            raise TorchrunWorkerAdapterError(f"worker policy adapter {spec!r}: the factory's result has no "
                                             "install(context) method")
        if isinstance(self._custom, BuiltInWorkerAdapter):  # a built-in named as the factory
            self._watch(self._custom)
            self.adapter = self._custom
        self._custom.install(self.context)

    # ------------------------------------------------------------------ hooks

    def _patch_dist(self, module: Any) -> None:
        destroy, init = module.destroy_process_group, module.init_process_group
        bootstrap = self

        def destroy_process_group(group: Any = None) -> Any:
            if group is None or group is module.GroupMember.WORLD:
                bootstrap.close()  # before the groups the session uses are gone
            return destroy(group)

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = init(*args, **kwargs)
            bootstrap._agree_on_framework()
            return result

        dist: Any = sys.modules.get("torch.distributed")
        for name, original, replacement in (("destroy_process_group", destroy, destroy_process_group),
                                            ("init_process_group", init, init_process_group)):
            setattr(module, name, functools.wraps(original)(replacement))
            if dist is not None and getattr(dist, name, None) is original:
                setattr(dist, name, getattr(module, name))

    def _agree_on_framework(self) -> None:
        """Once the default group is up, before any built-in adapter's attach collectives: every
        rank inferred the same framework (a rank that imported another one would wait in a
        different attach boundary)."""
        if not isinstance(self.adapter, BuiltInWorkerAdapter):
            return  # a custom stack's adapter owns its discovery
        names = gather(self.adapter.name)
        if len(set(names)) > 1:
            raise TorchrunWorkerAdapterError(
                f"{PREFIX}the ranks inferred different training frameworks when the default process group "
                "initialized (" + "; ".join(f"rank {rank}: {name}" for rank, name in enumerate(names)) + "). "
                "Every worker must import the same framework before init_process_group()")

    def _guard_sessions(self, module: Any) -> None:
        """Sessions are built only by this worker's adapter: user code that also attaches
        (enable_resiliency, a callback or plugin) would put two sessions on the same state."""
        original = module.ResiliencySession.__init__
        policy = self.policy.path

        def __init__(session: Any, *args: Any, **kwargs: Any) -> None:
            if not attaching():
                raise TorchrunWorkerAdapterError(
                    f"{PREFIX}this worker runs under the worker policy {policy} (lm_resiliency_worker_config), "
                    "which attaches lm-resiliency automatically; an explicit enable_resiliency(), "
                    "ResiliencyCallback or plugin would attach a second session to the same training state. "
                    "Remove the explicit call, or drop lm_resiliency_worker_config from --rdzv-conf")
            original(session, *args, **kwargs)

        module.ResiliencySession.__init__ = __init__

    def _record(self) -> None:
        """After each optimizer step: the newest captured and RECOVERY_VERIFIED steps for the agent,
        then end the generation if SCOUT's verdict requires verified recovery."""
        session = self.session
        if session is None:
            return
        ledger = session.ledger
        verified = ledger.recovery_verified_step if ledger is not None else None
        steps = (session.latest_gemini_step, -1 if verified is None else verified)
        if steps[0] >= 0 and steps != self._recorded:
            self._recorded = steps
            self._write_record(steps[0], steps[1], ())  # a new capture: earlier refusals are history
        self._faults.after_step(session)

    def _write_record(self, step: int, verified: int, refused: Any) -> None:
        c = self.context
        write_worker_record(self._directory, WorkerRecord(binding=c.binding, slot=c.slot, local_rank=c.local_rank,
                                                          step=step, verified_step=verified,
                                                          refused_steps=tuple(refused)))

    def _record_refusal(self, session: Any, selected: Optional[int], loaded: Optional[int]) -> None:
        """This generation could not start from what the agents selected: the step `selected` was
        not loadable on every rank (or, with `selected` None, GEMINI held state `loaded` of this run
        while the agents selected a fresh start). Record what every rank can load instead, so the
        next generation selects that and never `selected` again. Collective: every rank gets here
        alike (the refusal is collective) and asks GEMINI the same questions."""
        refused = set(self.context.refused_steps) | ({selected} if selected is not None else set())
        refused.discard(loaded)  # it just loaded on every rank
        step, verified = (-1, -1)
        try:
            step, verified = self._loadable(session, refused, loaded)
        finally:
            self._write_record(step, verified, sorted(refused))
            logger.error("%sgeneration %d could not start from %s; recorded for the agents: GEMINI can load %s "
                         "on every rank (refused: %s). The next generation starts from that", PREFIX,
                         self.context.generation, f"step {selected}" if selected is not None else "a fresh start",
                         f"step {step}" if step >= 0 else "nothing", sorted(refused) or "none")

    def _loadable(self, session: Any, refused: set, loaded: Optional[int]) -> Tuple[int, int]:
        """(the newest step every rank can load, the newest RECOVERY_VERIFIED one), -1 for none;
        never a `refused` step."""
        manager = session.manager
        if manager is None:
            return -1, -1
        if not manager.steps_seen:  # the refusal came before GEMINI gathered what the ranks hold
            manager.find_latest(allowed_steps=[])
        ledger = session.ledger
        certified = set(ledger.verified_steps()) if ledger is not None else set()
        candidates = sorted(set(manager.steps_seen) - refused)
        mode = RecoveryMode(self.policy.arguments.get("recovery_mode") or RecoveryMode.LATEST)
        if mode is RecoveryMode.RECOVERY_VERIFIED or (ledger is not None and ledger.requires_verified_recovery):
            candidates = [s for s in candidates if s in certified]
        latest = loaded if loaded is not None else (manager.find_latest(allowed_steps=candidates)
                                                    if candidates else None)
        verified_candidates = [s for s in candidates if s in certified]
        verified = manager.find_latest(allowed_steps=verified_candidates) if verified_candidates else None
        return (-1 if latest is None else latest), (-1 if verified is None else verified)

    def close(self) -> None:
        if self.adapter is not None:
            self.adapter.close()


_BOOTSTRAP: Optional[WorkerBootstrap] = None


def start(environ: Optional[Dict[str, str]] = None) -> Optional[WorkerBootstrap]:
    """Called by the shim in a torchrun worker. Inert in any other process (it marks the worker,
    so processes the worker starts skip it). Every error ends the worker with exit status 2."""
    global _BOOTSTRAP
    env = os.environ if environ is None else environ
    if env.get(BOOTSTRAP_ENV) or "LOCAL_RANK" not in env or not env.get(POLICY_ENV):
        return None
    env[BOOTSTRAP_ENV] = str(os.getpid())
    try:
        context = load_worker_context(env)
        policy = load_policy(context, env)
        env[CHECKPOINT_STEP_ENV] = str(context.checkpoint_step)
        if env.get("RANK") == "0":
            _say_where_the_loop_starts(context)
        bootstrap = WorkerBootstrap(context, policy)
        bootstrap.install()
    except Exception as exc:  # noqa: BLE001 - any bootstrap failure ends the worker before user code
        logging.getLogger(__name__).critical("lm-resiliency torchrun worker bootstrap failed: %s", exc)
        raise SystemExit(2) from None
    _BOOTSTRAP = bootstrap
    return bootstrap


def _say_where_the_loop_starts(context: TorchrunWorkerContext) -> None:
    """Rank 0, at every restart (and at a first generation that resumes): the step the loop must
    start from, in a line that shows with default logging."""
    if context.generation == 0 and context.checkpoint_source != "gemini":
        return
    where = (f"resumes run {context.run_id!r} at GEMINI step {context.checkpoint_step}"
             if context.checkpoint_source == "gemini" else f"of run {context.run_id!r} starts fresh at step 0")
    logging.getLogger(__name__).warning(
        "lm-resiliency torchrun worker: generation %d (%s) %s: the training loop must start at step %d, the value "
        "of %s (docs/torchrun.md, 'The one loop edit')", context.generation, context.decision, where,
        context.checkpoint_step, CHECKPOINT_STEP_ENV)
