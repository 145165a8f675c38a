"""What every built-in worker adapter shares: the policy's attach arguments, the all-rank
agreement before attaching, exact recovery of the step the rendezvous selected, the per-step
record for the agent, and close at teardown."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional

from lm_resiliency.recovered_state import EarlyLoads
from lm_resiliency.torchrun.context import POLICY_DIGEST_ENV, POLICY_ENV
from lm_resiliency.torchrun.imports import HIGHER_LEVEL
from lm_resiliency.torchrun.policy import WorkerPolicy, parse_policy, read_policy_bytes
from lm_resiliency.torchrun.retirement import require_verified_step
from lm_resiliency.torchrun.worker import TorchrunWorkerAdapterError, TorchrunWorkerContext

logger = logging.getLogger(__name__)

AGREE_TIMEOUT_S = 300.0
PREFIX = "lm-resiliency torchrun worker: "
_attaching = 0  # > 0 while a built-in adapter builds its session (the double-attach guard allows it)


def attaching() -> bool:
    """Whether a built-in worker adapter is building its session right now."""
    return _attaching > 0


def load_policy(context: TorchrunWorkerContext, environ: Optional[Mapping[str, str]] = None) -> WorkerPolicy:
    """The worker policy the rendezvous agreed on, revalidated against this generation's digest."""
    env = os.environ if environ is None else environ
    path = env.get(POLICY_ENV)
    if not path:
        raise TorchrunWorkerAdapterError(f"{POLICY_ENV} is not set: this worker was started without "
                                         "lm_resiliency_worker_config")
    policy = parse_policy(path, read_policy_bytes(path), env.get(POLICY_DIGEST_ENV) or "-")
    if context.policy_digest != policy.digest:
        raise TorchrunWorkerAdapterError(f"worker policy digest {policy.digest[:12]} is not the one this "
                                         f"generation was started with ({str(context.policy_digest)[:12]})")
    return policy


def gather(value: Any) -> List[Any]:
    """Collective when a process group is up: every rank's JSON `value`, by rank, over a
    temporary gloo group (so it does not depend on the application's backend or devices)."""
    import torch.distributed as dist

    from lm_resiliency import wire

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    group = wire.new_group(None, AGREE_TIMEOUT_S, "the torchrun worker agreement group")
    try:
        return wire.all_gather_json(value, group)
    finally:
        dist.destroy_process_group(group)


def agree(problem: str, what: str) -> None:
    """Collective when a process group is up: every rank reports its local problem ("" when it
    has none); all of them raise the same error if any rank has one."""
    bad = [f"rank {rank}: {text}" for rank, text in enumerate(gather(problem)) if text]
    if bad:
        raise TorchrunWorkerAdapterError(f"{PREFIX}not attaching ({what}): " + "; ".join(bad))


class BuiltInWorkerAdapter:
    """A built-in worker adapter (the TorchrunWorkerAdapter protocol: `install(context)`). Built
    by the bootstrap from the framework a worker imports; also usable as a custom
    `adapter = "lm_resiliency.integrations.torchrun:<Name>"` factory, which reads the policy from
    the environment the rendezvous gave the worker."""

    framework: ClassVar[str]

    def __init__(self, context: TorchrunWorkerContext, policy: Optional[WorkerPolicy] = None) -> None:
        self.context = context
        self.policy = policy if policy is not None else load_policy(context)
        self.session: Any = None
        self.on_step: Optional[Callable[[], None]] = None  # the bootstrap's record of captured steps
        self.fault_callback: Optional[Callable[[Any], None]] = None  # the bootstrap's SCOUT verdict watch
        self.oob_fault_callback: Optional[Callable[[Any], None]] = None  # the bootstrap's hang watch
        # The bootstrap's record of a selection this generation could not start from.
        self.on_recovery_refused: Optional[Callable[[Any, Optional[int], Optional[int]], None]] = None
        self.early_loads: Optional[EarlyLoads] = None  # the bootstrap's note of the script's own loads
        self.active = False
        self.started = False  # an attach began (it may have failed): never attach twice

    @property
    def name(self) -> str:
        return HIGHER_LEVEL.get(self.framework, "native PyTorch")

    def install(self, context: TorchrunWorkerContext) -> None:
        if context is not self.context:
            raise TorchrunWorkerAdapterError(f"{PREFIX}{type(self).__name__} was installed with another "
                                             "worker context than the one it was built for")
        self.active = True

    def deactivate(self, reason: str) -> None:
        """Another adapter takes over (a more specific framework was imported)."""
        if self.started:
            raise TorchrunWorkerAdapterError(f"{PREFIX}{reason} after the {self.name} worker adapter attached; "
                                             "import the training framework before building its model")
        self.active = False

    def attach_options(self) -> Any:
        from lm_resiliency.attach import AttachOptions

        arguments: Dict[str, Any] = dict(self.policy.arguments)
        if self.fault_callback is not None:
            arguments["fault_callback"] = self.fault_callback
        if self.oob_fault_callback is not None:
            arguments["oob_fault_callback"] = self.oob_fault_callback
        return AttachOptions(caller=f"worker policy {self.policy.path}", **arguments)

    def attach(self, adapter: Any, options: Any) -> Any:
        """`attach(adapter, options)` recovering exactly the selected step (or starting fresh)."""
        from lm_resiliency.attach import attach

        global _attaching
        context = self.context
        selected = context.checkpoint_step if context.checkpoint_source == "gemini" else None
        if self.early_loads is not None:
            # Before anything is recovered: the script's own resume would run on top of GEMINI's step.
            refusal = self.early_loads.refusal(gather(self.early_loads.problem(adapter.overwrite_targets())),
                                               context.run_id)
            if refusal is not None:
                raise TorchrunWorkerAdapterError(f"{PREFIX}not attaching: {refusal}")
        _attaching += 1
        try:
            self.session = attach(adapter, options, recover=lambda session: self._recover(session, selected))
        finally:
            _attaching -= 1
        logger.info("lm-resiliency torchrun worker: %s adapter attached (generation %d, step %d)", self.name,
                    context.generation, self.session.step_count)
        return self.session

    def _recover(self, session: Any, selected: Optional[int]) -> None:
        from lm_resiliency.gemini.manager import RecoveryUnavailable

        try:
            require_verified_step(session, self.context)
            step = session.recover(step=selected)
        except RecoveryUnavailable:
            self._refused(session, selected, None)
            raise
        if selected is None and step is not None:
            gemini = session.recovered_from == "gemini"
            self._refused(session, None, step if gemini else None)
            raise TorchrunWorkerAdapterError(
                f"{PREFIX}GEMINI resumed step {step} of run {self.context.run_id!r}, but the rendezvous selected a "
                "fresh start (no node recorded a capture it could use); refusing to continue from state the agents "
                "did not select." + (" The next generation starts from it" if gemini else ""))

    def _refused(self, session: Any, selected: Optional[int], loaded: Optional[int]) -> None:
        """Tell the bootstrap (it records what every rank can load for the agents); never masks the
        refusal itself."""
        if self.on_recovery_refused is None:
            return
        try:
            self.on_recovery_refused(session, selected, loaded)
        except Exception:  # noqa: BLE001 - the refusal is the error to raise
            logger.exception("%srecording the refused recovery for the agents failed", PREFIX)

    def stepped(self) -> None:
        """After each optimizer step: let the bootstrap record the newest complete capture."""
        if self.on_step is not None:
            self.on_step()

    def release_at(self, owner: Any, name: str) -> None:
        """Wrap `owner.<name>`, the framework's teardown (where the session's own hooks close it),
        so that this adapter lets go of the closed session too."""
        teardown = getattr(owner, name)

        @functools.wraps(teardown)
        def released(*args: Any, **kwargs: Any) -> Any:
            try:
                return teardown(*args, **kwargs)
            finally:
                self.session = None

        setattr(owner, name, released)

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()


def bundle_problem(missing: List[str], framework: str) -> str:
    """The local problem text for an incomplete object bundle ("" when nothing is missing)."""
    if not missing:
        return ""
    return f"the {framework} object bundle is incomplete: no {', no '.join(missing)}"
