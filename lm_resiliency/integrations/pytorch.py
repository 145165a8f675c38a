"""Explicit PyTorch entry point: devices, process groups and topology metadata passed directly."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lm_resiliency.api import enable_resiliency as _enable_resiliency
from lm_resiliency.session import ResiliencySession


def enable_resiliency(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                      device: Optional[torch.device] = None, process_group: Any = None,
                      **kwargs: Any) -> ResiliencySession:
    """Same as `lm_resiliency.enable_resiliency(..., framework="pytorch")`."""
    return _enable_resiliency(model, optimizer, framework="pytorch", device=device,
                              process_group=process_group, **kwargs)


__all__ = ["enable_resiliency"]
