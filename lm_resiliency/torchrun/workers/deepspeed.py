"""DeepSpeedWorkerAdapter: attaches to the engine `deepspeed.initialize()` returns, on every rank,
as `enable_resiliency(engine)` would (the DeepSpeed engine hooks: step, load_checkpoint, destroy).

After GEMINI recovered the selected step, `engine.load_checkpoint()` raises
TorchrunWorkerAdapterError (it would overwrite that state). In generation zero a successful load
before the first managed step is allowed and seeds the step counter from `engine.global_steps`.
`engine.destroy()` closes the session before DeepSpeed tears down.
"""

from __future__ import annotations

import functools
from typing import Any

from lm_resiliency.torchrun.imports import when_imported
from lm_resiliency.torchrun.workers.base import PREFIX, BuiltInWorkerAdapter, agree, bundle_problem
from lm_resiliency.torchrun.worker import TorchrunWorkerAdapterError


class DeepSpeedWorkerAdapter(BuiltInWorkerAdapter):
    """Attaches at the return of `deepspeed.initialize()` (one engine per worker)."""

    framework = "deepspeed"

    def install(self, context: Any) -> None:
        super().install(context)
        when_imported("deepspeed", self._patch)

    def _patch(self, module: Any) -> None:
        original = module.initialize

        @functools.wraps(original)
        def initialize(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if self.active:
                self._attach(result[0])
            return result

        module.initialize = initialize

    def _attach(self, engine: Any) -> None:
        if self.started:
            raise TorchrunWorkerAdapterError(
                f"{PREFIX}deepspeed.initialize() was called a second time; the built-in DeepSpeed adapter attaches "
                "to the one engine of a worker. Set adapter = \"package.module:factory\" for several engines")
        self.started = True
        missing = [] if getattr(engine, "optimizer", None) is not None else ["optimizer (engine.optimizer is None)"]
        agree(bundle_problem(missing, "DeepSpeed"),
              "every rank must return a training engine from deepspeed.initialize()")
        from lm_resiliency.adapters.deepspeed import with_config_section
        from lm_resiliency.callbacks.deepspeed import build_adapter

        self.attach(build_adapter(engine), with_config_section(engine, self.attach_options()))
        self._wrap(engine)

    def _wrap(self, engine: Any) -> None:
        """Over the engine hooks (the session's close removes these with them): the step record,
        and the refusal of a framework load after GEMINI recovery."""
        step, load = engine.step, engine.load_checkpoint
        session = self.session

        @functools.wraps(step)
        def stepped(*args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            self.stepped()
            return result

        @functools.wraps(load)
        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            if session.recovered_from == "gemini":
                raise TorchrunWorkerAdapterError(
                    f"{PREFIX}engine.load_checkpoint() refused: this generation recovered GEMINI step "
                    f"{self.context.checkpoint_step}, the step the rendezvous selected, and a DeepSpeed load would "
                    "overwrite that model and optimizer state. Load only in generation zero (LM_RESILIENCY_TORCHRUN_"
                    "CHECKPOINT_STEP is 0), or provide a custom worker adapter that coordinates both loaders")
            return load(*args, **kwargs)

        engine.step, engine.load_checkpoint = stepped, load_checkpoint
        self.release_at(engine, "destroy")
