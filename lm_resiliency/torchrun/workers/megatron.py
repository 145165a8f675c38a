"""MegatronWorkerAdapter: attaches to the model chunks and optimizer at the return of
`megatron.core.optimizer.get_megatron_optimizer(config, model_chunks, ...)`, on every rank, as
`integrations.megatron.enable_resiliency(model_chunks, optimizer)` would (the Megatron hooks on
`optimizer.step()` and the first chunk's forward).

Megatron Core has no training loop of its own; the optimizer that owns the chunks is its
construction boundary. The `OptimizerParamScheduler` is built after it (as Megatron-LM's
`setup_model_and_optimizer()` does): the first one constructed over that optimizer joins the
session, and the scheduler state of the recovered step is loaded into it then. A recovered step
with scheduler state and no scheduler by the first optimizer step fails closed.
`parallel_state.destroy_model_parallel()` closes the session before the groups are destroyed.
A worker that imported Megatron-LM's `megatron.training` fails closed (its setup loads its own
checkpoint after the optimizer is built).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from lm_resiliency.torchrun.imports import after_construction, when_imported
from lm_resiliency.torchrun.workers.base import PREFIX, BuiltInWorkerAdapter, agree, bundle_problem
from lm_resiliency.torchrun.worker import TorchrunWorkerAdapterError


class MegatronWorkerAdapter(BuiltInWorkerAdapter):
    """Attaches at the return of the worker's one `get_megatron_optimizer()` call."""

    framework = "megatron"
    adapter: Optional[Any] = None  # the LateSchedulerAdapter, once attached

    def install(self, context: Any) -> None:
        super().install(context)
        when_imported("megatron.core.optimizer", self._patch)
        when_imported("megatron.core.optimizer_param_scheduler",
                      lambda module: after_construction(module.OptimizerParamScheduler, self._adopt))
        when_imported("megatron.core.parallel_state", self._patch_teardown)

    def _patch(self, module: Any) -> None:
        original = module.get_megatron_optimizer

        @functools.wraps(original)
        def get_megatron_optimizer(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
            optimizer = original(config, model_chunks, *args, **kwargs)
            if self.active:
                self._attach(model_chunks, optimizer)
            return optimizer

        module.get_megatron_optimizer = get_megatron_optimizer

    def _patch_teardown(self, module: Any) -> None:
        original = module.destroy_model_parallel

        @functools.wraps(original)
        def destroy_model_parallel(*args: Any, **kwargs: Any) -> Any:
            self.close()  # before the groups the session uses are gone
            return original(*args, **kwargs)

        module.destroy_model_parallel = destroy_model_parallel

    def _attach(self, model_chunks: Any, optimizer: Any) -> None:
        if self.started:
            raise TorchrunWorkerAdapterError(
                f"{PREFIX}get_megatron_optimizer() was called a second time; the built-in Megatron Core adapter "
                "attaches to the one optimizer of a worker. Set adapter = \"package.module:factory\" for several "
                "optimizers")
        self.started = True
        from lm_resiliency.callbacks.megatron import MegatronStepHooks
        from lm_resiliency.torchrun.workers.megatron_state import LateSchedulerAdapter, megatron_lm_problem, missing

        agree(megatron_lm_problem() or bundle_problem(missing(model_chunks, optimizer), "Megatron Core"),
              "every rank must build its model chunks and optimizer with get_megatron_optimizer()")
        options = self.attach_options()
        self.adapter = LateSchedulerAdapter(model_chunks, optimizer, hooks=MegatronStepHooks,
                                             timeout_s=options.config.timeout_s)
        self.attach(self.adapter, options)
        step = optimizer.step  # the session's hook; the session's close removes this with it
        adapter = self.adapter

        @functools.wraps(step)
        def stepped(*args: Any, **kwargs: Any) -> Any:
            if adapter.pending is not None:
                raise TorchrunWorkerAdapterError(
                    f"{PREFIX}GEMINI recovered step {self.context.checkpoint_step} with OptimizerParamScheduler "
                    "state, and no OptimizerParamScheduler was built over this optimizer before its first step; "
                    "build the scheduler as in the run that captured it")
            result = step(*args, **kwargs)
            self.stepped()
            return result

        optimizer.step = stepped

    def _adopt(self, scheduler: Any) -> None:
        adapter = self.adapter
        if self.session is None or adapter is None or getattr(scheduler, "optimizer", None) is not adapter.optimizer:
            return
        if adapter.scheduler is not None:
            raise TorchrunWorkerAdapterError(
                f"{PREFIX}a second OptimizerParamScheduler was built over the attached Megatron optimizer; the "
                "built-in Megatron Core adapter captures one scheduler")
        adapter.adopt_scheduler(scheduler)
