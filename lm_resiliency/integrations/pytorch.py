"""Explicit PyTorch entry point: process groups and topology metadata passed directly."""

from __future__ import annotations

from typing import Any

import torch

from lm_resiliency.api import enable_resiliency as _enable_resiliency
from lm_resiliency.session import ResiliencySession


def enable_resiliency(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      **kwargs: Any) -> ResiliencySession:
    """Same as `lm_resiliency.enable_resiliency(..., framework="pytorch")`: the PyTorch adapter's
    `group`/`nccl_group` (SCOUT's peer group on this rank) and `parallelism_info` (a nonstandard
    mesh) say what inference cannot."""
    return _enable_resiliency(model, optimizer, framework="pytorch", **kwargs)


__all__ = ["enable_resiliency"]
