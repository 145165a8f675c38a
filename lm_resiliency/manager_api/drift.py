"""Configuration drift: find the ranks whose software or numerics settings differ from the job's.

Bitwise replay comparison (SCOUT) and exact recovery (GEMINI) assume every rank runs the same
software with the same numerics settings. A rank with another torch build, a different cuDNN, TF32
switched on, or another `NCCL_ALGO` produces different bits without any hardware fault, and SCOUT
would blame its hardware. `local_fingerprint()` describes this worker's configuration as a
JSON-ready document; a manager gathers one per rank (or the ranks gather them themselves with
`lm_resiliency.wire.all_gather_json`), `find_drift()` names the fields that differ and which ranks
hold the odd value, and `format_drift()` turns that into a short report.

Nothing here communicates: gathering is the caller's choice of transport.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import platform
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from lm_resiliency._values import is_int
from lm_resiliency.files import loads_strict_json

FINGERPRINT_VERSION = 1

# Installed distributions whose version changes what a training step computes.
_PACKAGES = ("lm-resiliency", "numpy", "triton", "lightning", "accelerate", "deepspeed",
             "megatron-core", "torchtitan", "transformers")

# Environment variables that change numerics, collectives or allocation. An explicit allow-list:
# environments hold credentials, and a fingerprint travels to a manager.
_ENV_NAMES = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "NVIDIA_TF32_OVERRIDE",
              "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
              "PYTORCH_NO_CUDA_MEMORY_CACHING", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
              "CUDA_MODULE_LOADING", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED",
              "TORCH_DISTRIBUTED_DEBUG")
_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
# A prefix match never reports a name that looks like it holds a credential.
_SECRET_MARKERS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "KEY", "AUTH")


def local_fingerprint(*, extra: Optional[Mapping[str, Any]] = None, optimizer: Any = None,
                      env_names: Iterable[str] = (), env_prefixes: Iterable[str] = ()) -> Dict[str, Any]:
    """This worker's configuration that must be identical on every rank, as a JSON-ready dict.

    Sections: ``python``, ``torch`` (version, CUDA/cuDNN/NCCL when present), ``packages`` (installed
    versions of the framework packages present), ``determinism`` (torch numerics switches),
    ``env`` (allow-listed variables that are set), ``devices``.

    extra: caller fields (a JSON-ready mapping, e.g. the data-pipeline seed or the config hash),
      reported under ``extra``.
    optimizer: a torch optimizer whose per-group hyperparameters (everything but ``params``) are
      reported under ``optimizer``.
    env_names / env_prefixes: more environment variables to report (exact names / prefixes).

    Reading device names initializes CUDA when a GPU is visible.
    """
    fingerprint: Dict[str, Any] = {
        "fingerprint_version": FINGERPRINT_VERSION,
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "machine": platform.machine()},
        "torch": _torch_build(),
        "packages": _package_versions(),
        "determinism": _determinism_settings(),
        "env": _allowed_env(tuple(env_names), tuple(env_prefixes)),
        "devices": _devices(),
    }
    if optimizer is not None:
        fingerprint["optimizer"] = _optimizer_hyperparameters(optimizer)
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"local_fingerprint(extra=...): must be a mapping of field name to JSON "
                            f"value, got {type(extra).__name__}")
        fingerprint["extra"] = loads_strict_json(_canonical_json(dict(extra), "local_fingerprint(extra=...)"))
    return fingerprint


def _torch_build() -> Dict[str, Any]:
    build: Dict[str, Any] = {"version": torch.__version__, "git_version": torch.version.git_version,
                             "debug": torch.version.debug}
    if torch.version.cuda is not None:
        build["cuda"] = torch.version.cuda
    if getattr(torch.version, "hip", None) is not None:
        build["hip"] = torch.version.hip
    if torch.backends.cudnn.is_available():
        build["cudnn"] = torch.backends.cudnn.version()
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        build["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    return build


def _package_versions() -> Dict[str, str]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _determinism_settings() -> Dict[str, Any]:
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    readers: Dict[str, Callable[[], Any]] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled,
        "deterministic_algorithms_warn_only": torch.is_deterministic_algorithms_warn_only_enabled,
        "float32_matmul_precision": torch.get_float32_matmul_precision,
        "default_dtype": lambda: str(torch.get_default_dtype()),
        "num_threads": torch.get_num_threads,
        "cudnn.enabled": lambda: cudnn.enabled,
        "cudnn.deterministic": lambda: cudnn.deterministic,
        "cudnn.benchmark": lambda: cudnn.benchmark,
        "cudnn.allow_tf32": lambda: cudnn.allow_tf32,
        "cuda.matmul.allow_tf32": lambda: matmul.allow_tf32,
        "cuda.matmul.allow_fp16_reduced_precision_reduction":
            lambda: matmul.allow_fp16_reduced_precision_reduction,
        "cuda.matmul.allow_bf16_reduced_precision_reduction":
            lambda: matmul.allow_bf16_reduced_precision_reduction,
    }
    # torch >= 2.9 also has per-backend fp32 precision switches (the newer TF32 API).
    for name, owner in (("fp32_precision", torch.backends), ("cuda.matmul.fp32_precision", matmul),
                        ("cudnn.fp32_precision", cudnn)):
        if hasattr(owner, "fp32_precision"):
            readers[name] = functools.partial(getattr, owner, "fp32_precision")
    settings = {}
    for name, read in readers.items():
        try:
            settings[name] = read()
        except RuntimeError as exc:
            # torch refuses to read a legacy TF32 flag once the legacy and new APIs were mixed;
            # that state is itself configuration worth comparing.
            settings[name] = f"unreadable ({type(exc).__name__}: {str(exc).split(',')[0]})"
    return settings


def _allowed_env(names: Tuple[str, ...], prefixes: Tuple[str, ...]) -> Dict[str, str]:
    exact = set(_ENV_NAMES) | set(names)
    found = {}
    for name, value in os.environ.items():
        by_prefix = (name.startswith(_ENV_PREFIXES + prefixes)
                     and not any(marker in name.upper() for marker in _SECRET_MARKERS))
        if name in exact or by_prefix:
            found[name] = value
    return dict(sorted(found.items()))


def _devices() -> Dict[str, Any]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices: Dict[str, Any] = {"cuda_count": count}
    if count:
        devices["cuda_names"] = [torch.cuda.get_device_name(i) for i in range(count)]
        devices["cuda_capabilities"] = [".".join(map(str, torch.cuda.get_device_capability(i)))
                                        for i in range(count)]
    return devices


def _optimizer_hyperparameters(optimizer: Any) -> Dict[str, Any]:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        raise TypeError(f"local_fingerprint(optimizer=...): expected a torch optimizer with "
                        f"param_groups, got {type(optimizer).__name__}")
    # Groups keyed by index so a changed hyperparameter shows as its own field.
    return {"class": type(optimizer).__name__,
            "param_groups": {str(i): {key: _plain(value) for key, value in sorted(group.items())
                                      if key != "params"}
                             for i, group in enumerate(groups)}}


def _plain(value: Any) -> Any:
    """A hyperparameter as a JSON value that is equal on two ranks exactly when the values are."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    # No repr: it can hold a memory address, which differs on every rank.
    return f"<{type(value).__name__}>"


def _canonical_json(value: Any, where: str) -> str:
    """`value` as JSON text that is equal for equal values (keys sorted)."""
    try:
        return json.dumps(value, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where}: must hold only JSON values (str, int, float, bool, None, lists, "
                        f"dicts with str keys; no NaN/inf): {exc}") from exc


Fingerprints = Union[Mapping[Union[int, str], Mapping[str, Any]], Sequence[Mapping[str, Any]]]


def find_drift(fingerprints: Fingerprints, *, ignore: Iterable[str] = ()) -> Dict[str, Dict[str, Any]]:
    """The fields whose values differ between ranks, as a JSON-ready dict (empty: no drift).

    fingerprints: rank -> fingerprint (int keys, or decimal strings as after a JSON round trip), or
      a list indexed by rank (what `lm_resiliency.wire.all_gather_json` returns). Nested dicts are
      compared field by field; a field is named by its dotted path (``env.NCCL_ALGO``).
    ignore: dotted paths to leave out, each with everything under it (e.g. ``"devices"`` for a job
      that deliberately mixes GPU models).

    Each drifting field maps to ``{"values": [...], "majority": ..., "minority_ranks": [...]}``.
    ``values`` lists ``{"value": v, "ranks": [...]}`` (``{"missing": true, "ranks": [...]}`` for
    ranks without the field), most ranks first, then by lowest rank. ``majority`` is the entry held
    by strictly more ranks than any other, or None on a tie; ``minority_ranks`` are the ranks
    outside it (every rank on a tie: nothing says which side is right). Fields and ranks are sorted.
    """
    by_rank = _ranked(fingerprints)
    ignored = tuple(ignore)
    flat = {rank: _flatten(fp, f"fingerprint of rank {rank}") for rank, fp in by_rank.items()}
    fields = sorted({name for fields in flat.values() for name in fields
                     if not any(name == p or name.startswith(p + ".") for p in ignored)})
    drift = {}
    for name in fields:
        holders: Dict[str, List[int]] = {}
        for rank in sorted(flat):
            holders.setdefault(flat[rank].get(name, "missing"), []).append(rank)
        if len(holders) > 1:
            drift[name] = _field_drift(holders)
    return drift


def _ranked(fingerprints: Fingerprints) -> Dict[int, Mapping[str, Any]]:
    if isinstance(fingerprints, Mapping):
        items = list(fingerprints.items())
    elif isinstance(fingerprints, Sequence) and not isinstance(fingerprints, (str, bytes)):
        items = list(enumerate(fingerprints))
    else:
        raise TypeError(f"find_drift: expected a dict rank -> fingerprint or a list indexed by rank, "
                        f"got {type(fingerprints).__name__}")
    by_rank: Dict[int, Mapping[str, Any]] = {}
    for key, fingerprint in items:
        rank = _rank(key)
        if rank in by_rank:
            raise ValueError(f"find_drift: rank {rank} appears twice (keys {key!r} and {rank!r} "
                             f"name the same rank)")
        if not isinstance(fingerprint, Mapping):
            raise TypeError(f"find_drift: the fingerprint of rank {rank} must be a dict (from "
                            f"local_fingerprint()), got {type(fingerprint).__name__}")
        by_rank[rank] = fingerprint
    return by_rank


def _rank(key: Any) -> int:
    if is_int(key) and key >= 0:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    raise ValueError(f"find_drift: rank keys must be non-negative ints or decimal strings, got {key!r}")


def _flatten(document: Mapping[str, Any], where: str, prefix: str = "") -> Dict[str, str]:
    """Dotted field name -> canonical JSON text of its value. ("missing" is never JSON text.)"""
    flat: Dict[str, str] = {}
    for key, value in document.items():
        if not isinstance(key, str):
            raise TypeError(f"find_drift: {where}: field names must be strings, got {key!r}")
        name = prefix + key
        if isinstance(value, Mapping):
            # An empty section holds no fields: an empty `env` equals one with nothing set.
            flat.update(_flatten(value, where, name + "."))
        else:
            flat[name] = _canonical_json(value, f"find_drift: {where}, field {name!r}")
    return flat


def _field_drift(holders: Dict[str, List[int]]) -> Dict[str, Any]:
    values: List[Dict[str, Any]] = [{"missing": True, "ranks": ranks} if key == "missing"
              else {"value": loads_strict_json(key), "ranks": ranks}
              for key, ranks in sorted(holders.items(), key=lambda item: (-len(item[1]), item[1][0]))]
    leader, runner_up = values[0], values[1]
    if len(leader["ranks"]) > len(runner_up["ranks"]):
        return {"values": values, "majority": dict(leader),
                "minority_ranks": sorted(rank for entry in values[1:] for rank in entry["ranks"])}
    return {"values": values, "majority": None,
            "minority_ranks": sorted(rank for entry in values for rank in entry["ranks"])}


def format_drift(drift: Mapping[str, Mapping[str, Any]]) -> str:
    """`find_drift`'s result as text: one line per drifting field, majority value first.

        env.NCCL_ALGO: "Ring" on ranks 0, 2-3 (majority); "Tree" on rank 1
    """
    if not drift:
        return "no configuration drift"
    lines = []
    for name, entry in drift.items():
        majority = entry.get("majority")
        parts = []
        for value in entry["values"]:
            shown = "unset" if value.get("missing") else _short(json.dumps(value["value"]))
            part = f"{shown} on {_ranks_text(value['ranks'])}"
            parts.append(part + " (majority)" if majority is not None and value == majority else part)
        lines.append(f"{name}: " + "; ".join(parts) + ("" if majority is not None else " (no majority)"))
    return "\n".join(lines)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``: contiguous runs collapsed so large jobs stay one line."""
    runs: List[List[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text
