"""The Megatron Core worker adapter's torch side (imported when it attaches, so that the
bootstrap imports no torch): the bundle check, and the Megatron adapter whose scheduler is built
after the attach."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

from torch import nn

from lm_resiliency.adapters.megatron import MegatronAdapter, is_megatron_optimizer


class LateSchedulerAdapter(MegatronAdapter):
    """The Megatron adapter whose scheduler is built after the attach: recovered scheduler state
    waits for it."""

    pending: Optional[Dict[str, Any]] = None

    def load_deferred_state(self, state: Dict[str, Any]) -> None:
        if self.scheduler is None:
            self.pending = state.get("scheduler")
            return
        super().load_deferred_state(state)

    def adopt_scheduler(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        pending, self.pending = self.pending, None
        if pending is not None:
            scheduler.load_state_dict(pending)


def missing(model_chunks: Any, optimizer: Any) -> List[str]:
    """What this rank lacks of the bundle get_megatron_optimizer() saw (empty when complete)."""
    absent = []
    if not isinstance(model_chunks, (list, tuple)) or not model_chunks or \
            not all(isinstance(chunk, nn.Module) for chunk in model_chunks):
        absent.append(f"model chunks (get_megatron_optimizer received {type(model_chunks).__name__}, not a "
                       "non-empty list of modules)")
    if not is_megatron_optimizer(optimizer):
        absent.append(f"MegatronOptimizer (get_megatron_optimizer returned {type(optimizer).__name__})")
    from megatron.core import parallel_state

    if not parallel_state.is_initialized():
        absent.append("model-parallel groups (call parallel_state.initialize_model_parallel() first)")
    return absent


def megatron_lm_problem() -> str:
    """Megatron-LM's setup_model_and_optimizer() loads its own checkpoint after it built the
    optimizer, over the state GEMINI would have recovered there: not this adapter's boundary."""
    if "megatron.training" not in sys.modules:
        return ""
    return ("Megatron-LM's megatron.training is imported, and its setup_model_and_optimizer() loads its own "
            "checkpoint after get_megatron_optimizer() returns; set adapter = \"package.module:factory\" to a "
            "custom adapter that calls lm_resiliency.integrations.megatron.enable_resiliency(model, optimizer, "
            "opt_param_scheduler=..., iteration=args.iteration) after setup_model_and_optimizer()")
