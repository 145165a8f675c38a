"""Backward replay of a sampled module whose parameters are whole on every peer (dense, or
FSDP/HSDP once unsharded): its output gradient from the real backward, then the gradients of a
private recomputation with respect to its inputs and parameters.

On the source, `OutputGradCapture` puts a tensor hook on each output of the module's first call
(not a module full-backward hook, which would rewrap the module's outputs in training). The
hooks copy the gradient the real backward delivers and change nothing. Every peer then
recomputes the forward with grad enabled on private copies of the shared inputs and asks
`torch.autograd.grad` for the gradients: `autograd.grad` never accumulates into `.grad` and does
not run the parameters' AccumulateGrad nodes, so DDP's reducer hooks are not triggered and live
gradients stay untouched. A device that corrupts the backward (a faulty kernel, or a module
backward hook on that rank) produces different gradient bytes and loses the vote.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn


class OutputGradCapture:
    """Forward hook that marks one call's outputs; their gradients are copied during backward."""

    def __init__(self, module: nn.Module, tensors_in: Any) -> None:
        self.grads: Optional[List[Optional[torch.Tensor]]] = None
        self._tensors_in = tensors_in
        self._handle = module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.remove()
        if not torch.is_grad_enabled():
            return None
        outputs = self._tensors_in(output)
        grads: List[Optional[torch.Tensor]] = [None] * len(outputs)
        self.grads = grads
        for index, tensor in enumerate(outputs):
            if tensor.requires_grad:
                tensor.register_hook(self._store(grads, index))
        return None

    @staticmethod
    def _store(grads: List[Optional[torch.Tensor]], index: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            grads[index] = grad.detach().clone()
        return hook

    @property
    def captured(self) -> bool:
        return self.grads is not None and any(g is not None for g in self.grads)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def grad_leaf(value: torch.Tensor, leaves: List[torch.Tensor]) -> torch.Tensor:
    """A floating-point input as a clone of a fresh leaf that requires grad (appended to `leaves`):
    the module may modify its inputs in place. Other tensors pass unchanged. Call in grad mode."""
    if not value.is_floating_point():
        return value
    leaf = value.detach().requires_grad_(True)
    leaves.append(leaf)
    return leaf.clone()


def replay_gradients(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[Optional[torch.Tensor]],
                     inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """Gradients of the recomputed `outputs`, weighted by the source's `grad_outputs`, with
    respect to `inputs` then `params` (None where one does not reach the outputs)."""
    if len(outputs) != len(grad_outputs):
        raise ValueError(f"the replayed module returned {len(outputs)} tensors, the source's backward "
                         f"delivered gradients for {len(grad_outputs)}")
    pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs) if grad is not None and out.requires_grad]
    wrt = [*inputs, *(p for p in params if p.requires_grad)]
    if not pairs or not wrt:
        return []
    return list(torch.autograd.grad([out for out, _ in pairs], wrt, [grad for _, grad in pairs],
                                    allow_unused=True))
