"""TorchTitanWorkerAdapter: attaches to the `torchtitan.trainer.Trainer` as its construction
finishes (the outermost __init__, a subclass's included), as `enable_resiliency(trainer)` would
right before `train()` (the TorchTitan trainer hooks on its checkpointer: `train()`'s
`checkpointer.load()` is skipped when GEMINI recovered the selected step, a newer durable
checkpoint is refused; `trainer.close()` closes the session first)."""

from __future__ import annotations

import functools
from typing import Any

from lm_resiliency.torchrun.imports import after_construction, when_imported
from lm_resiliency.torchrun.workers.base import PREFIX, BuiltInWorkerAdapter, agree, bundle_problem
from lm_resiliency.torchrun.worker import TorchrunWorkerAdapterError

_BUNDLE = ("model_parts", "optimizers", "lr_schedulers", "dataloader", "checkpointer", "parallel_dims")


class TorchTitanWorkerAdapter(BuiltInWorkerAdapter):
    """Attaches once the worker's one TorchTitan Trainer is constructed."""

    framework = "torchtitan"

    def install(self, context: Any) -> None:
        super().install(context)
        when_imported("torchtitan.trainer", lambda module: after_construction(module.Trainer, self._attach))

    def _attach(self, trainer: Any) -> None:
        if not self.active:
            return
        if self.started:
            raise TorchrunWorkerAdapterError(
                f"{PREFIX}a second TorchTitan Trainer was constructed; the built-in TorchTitan adapter attaches to "
                "the one trainer of a worker. Set adapter = \"package.module:factory\" for several trainers")
        self.started = True
        missing = [name for name in _BUNDLE if getattr(trainer, name, None) is None]
        agree(bundle_problem(missing, "TorchTitan Trainer"), "every rank must construct one complete Trainer")
        from lm_resiliency.callbacks.torchtitan import build_adapter

        self.attach(build_adapter(trainer), self.attach_options())
        checkpointer = trainer.checkpointer
        save = checkpointer.save  # the session's hook; the session's close removes this with it

        @functools.wraps(save)
        def saved(*args: Any, **kwargs: Any) -> Any:
            result = save(*args, **kwargs)
            self.stepped()
            return result

        checkpointer.save = saved
        self.release_at(checkpointer, "close")
