"""Reference replays: a tie-breaker in time for votes that signatures alone cannot decide.

A vote cannot tell a healthy majority from ranks that are faulty alike and outnumber the healthy
ones. What breaks the symmetry is an earlier computation every peer agreed on: after a clean
forward vote, each peer keeps (on the host) the invocation it replayed, the module's parameters
and buffers at that step, and the agreed output signature. When a later vote on the same module
disagrees, every peer replays that reference again on its device through
`torch.func.functional_call` (the module's real forward and hooks, with the old state) and checks
that it still reproduces the agreed signature. A peer that cannot is faulty now, whatever the
vote's majority says. A module's first agreed replay stays its reference (copied once per run);
references are bounded by `ReplayHarnessConfig.reference_max_bytes` (oldest evicted first; 0
keeps none).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import nn

from lm_resiliency.codec import Layout, decode_state
from lm_resiliency.scout.invocation import Autocast, SeededRng, module_device, preserved_buffers, tensors_in, to_device
from lm_resiliency.scout.signature import structure_signature

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reference:
    step: int
    header: dict
    payload: torch.Tensor             # host copy of the shared invocation bytes
    state: Dict[str, torch.Tensor]    # host copy of the module's parameters and buffers
    signature: str                    # the output signature every peer agreed on

    @property
    def nbytes(self) -> int:
        return self.payload.numel() + sum(t.numel() * t.element_size() for t in self.state.values())


class ReferenceStore:
    """References by module path; `stage` during a replay, `promote` once its vote was clean."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._refs: "OrderedDict[str, Reference]" = OrderedDict()
        self._pending: Dict[str, Reference] = {}

    def stage(self, path: str, step: int, header: dict, payload: torch.Tensor, module: nn.Module) -> None:
        # Any earlier agreement serves as a reference, so a module's first one is kept: its
        # parameters cross to the host once per run, not at every check.
        if self.max_bytes <= 0 or path in self._refs:
            return
        state = {name: t.detach().to("cpu", copy=True)
                 for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
        ref = Reference(step, dict(header), payload.to("cpu", copy=True), state, "")
        if ref.nbytes <= self.max_bytes:
            self._pending[path] = ref

    def promote(self, path: str, signature: str) -> None:
        ref = self._pending.pop(path, None)
        if ref is None:
            return
        self._refs.pop(path, None)
        self._refs[path] = Reference(ref.step, ref.header, ref.payload, ref.state, signature)
        total = sum(r.nbytes for r in self._refs.values())
        while total > self.max_bytes and self._refs:
            total -= self._refs.popitem(last=False)[1].nbytes

    def discard_pending(self) -> None:
        self._pending = {}

    def get(self, path: str) -> Optional[Reference]:
        return self._refs.get(path)

    def self_test(self, ref: Reference, module: nn.Module, seed: int) -> bool:
        """Whether this peer still reproduces `ref`'s agreed output. A replay that raises fails."""
        device = module_device(module)
        try:
            invocation = decode_state(ref.header["structure"], list(Layout.from_json(ref.header["layout"])
                                                                     .views(ref.payload)))
            args, kwargs = to_device(invocation["args"], device), to_device(invocation["kwargs"], device)
            state = {name: t.to(device) for name, t in ref.state.items()}
            with preserved_buffers(module), torch.no_grad(), SeededRng(seed + ref.step, device), \
                    Autocast(ref.header.get("autocast")):
                out = torch.func.functional_call(module, state, tuple(args), kwargs)
            return structure_signature(tensors_in(out)) == ref.signature
        except Exception as exc:  # noqa: BLE001 - a peer that cannot rerun the reference fails it
            logger.warning("SCOUT reference replay from step %d failed: %s", ref.step, exc)
            return False
