"""The wrappers a user's model comes in, and the module inside them.

DistributedDataParallel and DataParallel hold the user's module as `module` (their state_dict
keys gain `module.`); torch.compile's OptimizedModule holds it as `_orig_mod` (`_orig_mod.`).
They nest in any order (`torch.compile(DDP(m))`, `DDP(torch.compile(m))`). Also the module's
persistent buffers, which every adapter that captures module by module needs."""

from __future__ import annotations

import sys
from typing import Dict, Iterator, Optional

import torch
from torch import nn

from lm_resiliency._torch_compat import non_persistent_buffer_names


def _is_compiled_wrapper(module: nn.Module) -> bool:
    # torch.compile loads torch._dynamo; a process that never imported it holds no OptimizedModule.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def wrapper_chain(model: nn.Module) -> Iterator[nn.Module]:
    """`model`, then each module it wraps, outermost first; the last is the user's module."""
    while True:
        yield model
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif _is_compiled_wrapper(model):
            model = model._orig_mod
        else:
            return


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose state_dict keys and submodule paths are the user's."""
    *_, inner = wrapper_chain(model)
    return inner


def find_ddp(model: nn.Module) -> Optional[nn.parallel.DistributedDataParallel]:
    """The DistributedDataParallel object `model` is or wraps (through torch.compile); else None."""
    for wrapper in wrapper_chain(model):
        if isinstance(wrapper, nn.parallel.DistributedDataParallel):
            return wrapper
    return None


def persistent_buffers(module: nn.Module) -> Dict[str, torch.Tensor]:
    """`module`'s buffers that its state_dict holds (non-persistent ones, e.g. rotary caches a
    framework rebuilds, are left out), by qualified name."""
    out = {}
    for prefix, sub in module.named_modules():
        left_out = non_persistent_buffer_names(sub)
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in left_out:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out
