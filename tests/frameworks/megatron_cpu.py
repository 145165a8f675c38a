"""Test-only: the CUDA calls on Megatron Core 0.16's training path, replaced by CPU equivalents.

Megatron Core builds a GPTModel on CPU (`use_cpu_initialization=True`), but its forward pass,
`DistributedDataParallel`, `get_megatron_optimizer` and `optimizer.step()` call CUDA. `install()`
replaces exactly these, in Megatron's modules only (torch itself, and lm-resiliency's adapter and
surface under test, are never patched):

1. `torch` as seen by the Megatron modules in `_MODULES`: a proxy whose tensor factories
   (`tensor`, `zeros`, `empty`, `ones`, `full`, `arange`) turn `device="cuda"` / a CUDA index
   into CPU, and whose `torch.cuda.current_device()` is the CPU device, `synchronize()` a no-op,
   `get_rng_state`/`manual_seed` the CPU generator's. Why: the param/grad buffers, the global
   memory buffer of the attention, the causal mask, the optimizer's found-inf/scale tensors and
   the grad-norm reduction allocate on `"cuda"`.
2. `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`: the CPU generator's
   state. Why: the model-parallel RNG tracker forks the CUDA generator around dropout.
3. `optimizer.clip_grad_by_total_norm_fp32`: the same scaling (`multi_tensor_scale` over the
   grads by `max_norm / (total_norm + 1e-6)` when below 1) without its
   `param.grad.type() == 'torch.cuda.FloatTensor'` assertion.
4. `DistributedOptimizer._build_model_and_main_param_groups`: runs with each parameter's
   `type()` answering the CUDA type name of its dtype. Why: it sorts parameters into fp32 and
   fp16/bf16 groups by comparing `param.type()` with `'torch.cuda.FloatTensor'` and friends.

What stays CUDA-only is listed in docs/frameworks.md (Megatron Core section) and covered by the
`gpu` test in test_megatron.py.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

_MODULES = (
    "megatron.core.utils",                                  # global memory buffer (attention)
    "megatron.core.transformer.utils",                      # default causal mask
    "megatron.core.tensor_parallel.random",                 # RNG tracker seeding
    "megatron.core.distributed.param_and_grad_buffer",      # param and grad buffers
    "megatron.core.distributed.distributed_data_parallel",  # DDP buffers
    "megatron.core.optimizer.optimizer",                    # found_inf, scale tensors
    "megatron.core.optimizer.grad_scaler",                  # a constant or dynamic loss scale
    "megatron.core.optimizer.clip_grads",                   # grad-norm reduction buffers
    "megatron.core.optimizer.distrib_optimizer",            # optimizer state shards
)
_FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "arange")
_CUDA_TYPE = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
              torch.float16: "torch.cuda.HalfTensor"}


def _on_cpu(device: Any) -> Any:
    if isinstance(device, int) or (device is not None and str(device).startswith("cuda")):
        return torch.device("cpu")
    return device


def _factory(function: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return function(*args, **kwargs)

    return make


class _CpuCuda:
    get_rng_state = staticmethod(torch.get_rng_state)
    manual_seed = staticmethod(torch.manual_seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None


class _CpuTorch:
    cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        return _factory(value) if name in _FACTORIES else value


def install() -> None:
    """Apply the replacements above (idempotent; call in each rank before building the model)."""
    proxy = _CpuTorch()
    for name in _MODULES:
        importlib.import_module(name).torch = proxy
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")

    def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                     use_decoupled_grad: bool = False) -> None:
        grads = [p.grad.detach() for p in parameters if p.grad is not None]
        assert all(g.dtype == torch.float32 for g in grads)
        coefficient = max_norm / (total_norm + 1.0e-6)
        if coefficient < 1.0:
            clip.multi_tensor_applier(clip.multi_tensor_scale_impl, torch.zeros(1, dtype=torch.int),
                                      [grads, grads], coefficient)

    importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32 = \
        clip_grad_by_total_norm_fp32
    optimizer_class = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
    build = optimizer_class.__dict__["_build_model_and_main_param_groups"]
    if getattr(build.__func__, "_cpu_fixture", False):
        return
    original = build.__func__

    def build_groups(cls: Any, gbuf_ranges: Any, param_gbuf_map: Any, opt_group_ranges: Any,
                     *args: Any, **kwargs: Any) -> Any:
        params = [p for group in opt_group_ranges for p in group["params"]]
        for param in params:
            param.type = (lambda name: lambda *a: name)(_CUDA_TYPE[param.dtype])
        try:
            return original(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, *args, **kwargs)
        finally:
            for param in params:
                del param.type

    build_groups._cpu_fixture = True  # type: ignore[attr-defined]
    optimizer_class._build_model_and_main_param_groups = classmethod(build_groups)
