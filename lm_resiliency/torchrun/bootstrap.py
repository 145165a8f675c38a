"""The zero-import worker bootstrap (runs in every torchrun worker before its user module when
the rendezvous has `lm_resiliency_worker_config`).

1. Reads the agent's restart context and revalidates the policy digest agreed at rendezvous;
   publishes the selected step as LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP.
2. Watches imports: a second higher-level framework (DeepSpeed, TorchTitan, Megatron Core) fails
   the import; a custom `adapter = "package.module:factory"` is installed at once.
3. Native PyTorch DDP: records DistributedDataParallel and optimizer construction; at the first
   DDP forward every rank checks it owns exactly one DDP model and one optimizer that owns all its
   trainable parameters, the ranks agree, and only then `attach` runs and recovers exactly the
   selected step (or fails closed).
4. Records each completely captured step for the agent; closes the session when the default
   process group is destroyed (before it is), or at exit.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional

from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.context import POLICY_DIGEST_ENV, POLICY_ENV
from lm_resiliency.torchrun.policy import WorkerPolicy, parse_policy, read_policy_bytes
from lm_resiliency.torchrun.retirement import FaultWatch, require_verified_step
from lm_resiliency.torchrun.worker import (BOOTSTRAP_ENV, CHECKPOINT_STEP_ENV, TorchrunWorkerAdapterError,
                                           TorchrunWorkerContext, load_worker_context)

logger = logging.getLogger(__name__)

HIGHER_LEVEL = {"deepspeed": "DeepSpeed", "torchtitan": "TorchTitan", "megatron": "Megatron Core"}
_DDP_MODULE = "torch.nn.parallel.distributed"
_OPTIM_MODULE = "torch.optim.optimizer"
_DIST_MODULE = "torch.distributed.distributed_c10d"
_AGREE_TIMEOUT_S = 300.0


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Notes higher-level framework imports and runs a callback after chosen modules execute."""

    def __init__(self, on_framework: Callable[[str], None], after: Dict[str, Callable[[Any], None]]) -> None:
        self.on_framework = on_framework
        self.after = after

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name in HIGHER_LEVEL:
            self.on_framework(name)
        callback = self.after.get(name)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this loader instance only
        return spec


def _after_init(cls: Any, callback: Callable[[Any], None]) -> None:
    """Call `callback(obj)` after every `cls(...)` construction, subclasses' included."""
    original = cls.__init__

    def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
        original(obj, *args, **kwargs)
        callback(obj)

    cls.__init__ = __init__


class WorkerBootstrap:
    """One worker process's automatic instrumentation."""

    def __init__(self, context: TorchrunWorkerContext, policy: WorkerPolicy) -> None:
        self.context = context
        self.policy = policy
        self.frameworks: List[str] = []
        self.models: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.session: Any = None
        self._hooks: List[Any] = []
        self._attached = False
        self._recorded = (-1, -1)
        self._custom: Any = None
        self._faults = FaultWatch(context.run_id, context.generation, os.path.dirname(context.context_path),
                                  context.local_rank, context.local_world_size)

    # ----------------------------------------------------------------- imports

    def install(self) -> None:
        after: Dict[str, Callable[[Any], None]] = {
            _DDP_MODULE: self._patch_ddp, _OPTIM_MODULE: self._patch_optimizer, _DIST_MODULE: self._patch_dist}
        for name in list(HIGHER_LEVEL):
            if name in sys.modules:
                self._note_framework(name)
        for name, patch in list(after.items()):
            if name in sys.modules:  # torch was imported before the bootstrap (another sitecustomize)
                patch(sys.modules[name])
                del after[name]
        sys.meta_path.insert(0, _ImportWatch(self._note_framework, after))
        if self.policy.adapter is not None:
            self._install_custom(self.policy.adapter)

    def _note_framework(self, name: str) -> None:
        if name in self.frameworks:
            return
        self.frameworks.append(name)
        if len(self.frameworks) > 1:
            names = " and ".join(HIGHER_LEVEL[n] for n in self.frameworks)
            raise TorchrunWorkerAdapterError(
                f"lm-resiliency torchrun worker: {names} are both imported; the worker adapter is chosen from the "
                "one higher-level framework a worker uses and is never picked arbitrarily. Import one, or set "
                "adapter = \"package.module:factory\" in the worker policy")
        if self.policy.adapter is None:
            raise TorchrunWorkerAdapterError(
                f"lm-resiliency torchrun worker: {HIGHER_LEVEL[name]} was imported, and its built-in worker adapter "
                "is not available in this release. Set adapter = \"package.module:factory\" in the worker policy, "
                "or drop lm_resiliency_worker_config and call enable_resiliency() explicitly")

    def _install_custom(self, spec: str) -> None:
        module_name, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module_name), attr, None)
        if not callable(factory):
            raise TorchrunWorkerAdapterError(f"worker policy adapter {spec!r}: {attr} is not a callable factory")
        self._custom = factory(self.context)
        if not callable(getattr(self._custom, "install", None)):
            raise TorchrunWorkerAdapterError(f"worker policy adapter {spec!r}: the factory's result has no "
                                             "install(context) method")
        self._custom.install(self.context)

    # -------------------------------------------------------- construction hooks

    def _patch_ddp(self, module: Any) -> None:
        _after_init(module.DistributedDataParallel, self._note_model)

    def _patch_optimizer(self, module: Any) -> None:
        _after_init(module.Optimizer, self.optimizers.add)

    def _patch_dist(self, module: Any) -> None:
        original = module.destroy_process_group
        bootstrap = self

        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            bootstrap.close()  # before the groups the session uses are gone
            return original(*args, **kwargs)

        module.destroy_process_group = destroy_process_group
        dist: Any = sys.modules.get("torch.distributed")
        if dist is not None and getattr(dist, "destroy_process_group", None) is original:
            dist.destroy_process_group = destroy_process_group

    def _note_model(self, ddp: Any) -> None:
        if self._custom is not None or self._attached:
            return
        self.models.add(ddp)
        self._hooks.append(ddp.register_forward_pre_hook(lambda module, args: self._attach(module), prepend=True))

    # ------------------------------------------------------------------ attach

    def _local_problem(self, ddp: Any) -> str:
        from lm_resiliency.adapters.pytorch import check_optimizer_owns_model, unwrap_model

        if self.frameworks:
            return f"{HIGHER_LEVEL[self.frameworks[0]]} is imported next to a plain DDP model"
        if len(self.models) != 1:
            return f"{len(self.models)} DistributedDataParallel models exist; the worker adapter needs exactly one"
        optimizers = list(self.optimizers)
        if len(optimizers) != 1:
            return f"{len(optimizers)} optimizers exist; the worker adapter needs exactly one for the DDP model"
        try:
            check_optimizer_owns_model(unwrap_model(ddp), optimizers[0])
        except ValueError as exc:
            return str(exc)
        return ""

    def _attach(self, ddp: Any) -> None:
        if self._attached:
            return
        self._attached = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        from lm_resiliency import wire

        problem = self._local_problem(ddp)
        group = wire.new_group(None, _AGREE_TIMEOUT_S, "the torchrun worker agreement group")
        try:
            problems = wire.all_gather_json(problem, group)
        finally:
            import torch.distributed as dist

            dist.destroy_process_group(group)
        bad = [f"rank {rank}: {text}" for rank, text in enumerate(problems) if text]
        if bad:
            raise TorchrunWorkerAdapterError("lm-resiliency torchrun worker: not attaching (every rank must own "
                                             "exactly one DDP model and its one optimizer): " + "; ".join(bad))
        self._start_session(ddp, list(self.optimizers)[0])

    def _start_session(self, ddp: Any, optimizer: Any) -> None:
        from lm_resiliency.adapters.pytorch import PyTorchAdapter
        from lm_resiliency.attach import AttachOptions, attach

        options = AttachOptions(caller=f"worker policy {self.policy.path}",
                                fault_callback=self._faults.on_replay_result, **self.policy.arguments)
        adapter = PyTorchAdapter(ddp, optimizer, skip_replication_if_hsdp=options.config.skip_replication_if_hsdp)
        context = self.context
        selected = context.checkpoint_step if context.checkpoint_source == "gemini" else None
        self.session = attach(adapter, options, recover=lambda session: self._recover(session, selected))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._record())

    def _recover(self, session: Any, selected: Optional[int]) -> None:
        require_verified_step(session, self.context)
        step = session.recover(step=selected)
        if selected is None and step is not None:
            raise TorchrunWorkerAdapterError(
                f"lm-resiliency torchrun worker: GEMINI resumed step {step} of run {self.context.run_id!r}, but the "
                "rendezvous selected a fresh start (no node recorded a capture); refusing to continue from state "
                "the agents do not know about. Use a new --rdzv-id, or remove that run's GEMINI state")

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
            ctx.write_worker_record(os.path.dirname(self.context.context_path), self.context.local_rank,
                                    self.context.run_id, steps[0], self.context.local_world_size, steps[1])
        self._faults.after_step(session)

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()


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
        policy = parse_policy(env[POLICY_ENV], read_policy_bytes(env[POLICY_ENV]), env.get(POLICY_DIGEST_ENV) or "-")
        if context.policy_digest != policy.digest:
            raise TorchrunWorkerAdapterError(f"worker policy digest {policy.digest[:12]} is not the one this "
                                             f"generation was started with ({str(context.policy_digest)[:12]})")
        env[CHECKPOINT_STEP_ENV] = str(context.checkpoint_step)
        bootstrap = WorkerBootstrap(context, policy)
        bootstrap.install()
    except Exception as exc:  # noqa: BLE001 - any bootstrap failure ends the worker before user code
        logging.getLogger(__name__).critical("lm-resiliency torchrun worker bootstrap failed: %s", exc)
        raise SystemExit(2) from None
    _BOOTSTRAP = bootstrap
    return bootstrap
