"""Test-only patches that let TorchTitan 0.3's real `Trainer` train on CPU over gloo.

Nothing here touches lm-resiliency: every patch changes TorchTitan or torch so that a CPU process
can run what TorchTitan only runs on GPUs. `apply()` must run before `torchtitan` is imported.
Each patch says why it is needed; a GPU run needs none of them.

`write_assets(folder)` makes the tiny local tokenizer and text dataset the wheel does not ship.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

import torch

_APPLIED = False


class _CpuDeviceModule(types.ModuleType):
    """`torch.cpu` plus the CUDA-module functions TorchTitan calls on its device module (memory
    statistics, device properties), answered with CPU-neutral values."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name in ("memory_stats",):
            return lambda *a, **k: {}
        if name == "get_device_name":
            return lambda *a, **k: "cpu"
        if name == "get_device_properties":
            return lambda *a, **k: types.SimpleNamespace(total_memory=1 << 34, name="cpu")
        if name in ("mem_get_info",):
            return lambda *a, **k: (1 << 34, 1 << 34)
        return lambda *a, **k: None  # reset_peak_memory_stats, empty_cache, set_device, ...


def apply() -> None:
    """Install the six patches (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    # (1) minimal_async_ep.kernels imports triton at import time (via the MoE token dispatcher, which
    #     every model imports); the dense debug model never calls it.
    stub = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
    stub.__getattr__ = lambda name: None  # type: ignore[attr-defined]
    sys.modules["torchtitan.distributed.minimal_async_ep.kernels"] = stub

    # (6) torch 2.13 has no public torch.distributed.set_timeout (TorchTitan calls it after step 1).
    if not hasattr(torch.distributed, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        torch.distributed.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)

    # (2) TorchTitan picks the device when torchtitan.tools.utils is imported and falls back to
    #     cuda (and then nccl): point every module that copied the value at CPU / gloo.
    import torchtitan.tools.utils as tutils

    device_module = _CpuDeviceModule()
    tutils.device_type, tutils.device_module = "cpu", device_module
    tutils.get_local_device = lambda: torch.device("cpu")
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dutils

    for module in (metrics, dutils, parallel_dims):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device_module
    dutils.get_local_device = lambda: torch.device("cpu")
    original_barrier = torch.distributed.barrier
    torch.distributed.barrier = lambda *a, device_ids=None, **k: original_barrier(*a, **k)

    # (3) the compiled flex_attention needs Inductor max-autotune, which fails on CPU: use the eager one.
    from torch.nn.attention import flex_attention as flex
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = flex.flex_attention

    # (4) flex attention refuses CPU tensors that need grad; its eager CPU backward is the math
    #     one (it matches SDPA), so let the device check accept them.
    original_check = flex._validate_device

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type == "cpu":
            return
        original_check(query, key, value)

    flex._validate_device = validate_device

    # (5) gloo has no PREMUL_SUM, which FSDP2 uses once TorchTitan sets a gradient divide factor:
    #     reduce with a plain sum (TorchTitan scales the loss by the global token count itself).
    import torchtitan.distributed.fsdp as fsdp

    def disable_division(model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division
    _APPLIED = True


def write_assets(folder: str, documents: int = 64) -> tuple:
    """A byte-level tokenizer (256 bytes + BOS/EOS) and a jsonl text dataset under `folder`.
    Returns (tokenizer folder, dataset folder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    tokenizer_dir = os.path.join(folder, "tokenizer")
    data_dir = os.path.join(folder, "data")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<|begin_of_text|>"] = len(vocab)
    vocab["<|end_of_text|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bakers".split()
    lines = [json.dumps({"text": " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40 + i % 13))})
             for i in range(documents)]
    files = {
        os.path.join(tokenizer_dir, "tokenizer.json"): tokenizer.to_str(),
        os.path.join(tokenizer_dir, "tokenizer_config.json"): json.dumps({
            "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
            "add_eos_token": True}),
        os.path.join(data_dir, "train.jsonl"): "\n".join(lines) + "\n",
    }
    for path, text in files.items():
        # Every rank writes the same bytes; the rename keeps a reader from seeing a partial file.
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return tokenizer_dir, data_dir


def debug_config(assets: str, dump_folder: str, *, steps: int, seq_len: int = 64, batch: int = 2,
                 config: Any = None) -> Any:
    """`config` (default: `llama3_debugmodel()`) shrunk for CPU: FSDP2 over all ranks, partial_dtensor
    backend (the default backend fails at fully_shard on torch 2.13), no validation, DCP checkpoints off."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    tokenizer_dir, data_dir = write_assets(assets)
    config = config if config is not None else llama3_debugmodel()
    config.hf_assets_path = tokenizer_dir
    config.dump_folder = dump_folder
    config.dataloader.dataset_path = data_dir
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.metrics.log_freq = 1000
    config.checkpoint.enable = False
    return config


__all__ = ["apply", "debug_config", "write_assets"]
