"""`TorchrunLaunchConfig`: the common torchrun arguments of an lm-resiliency run. It builds an
argument list; it never starts processes, talks to a scheduler, or places GPUs."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence

from lm_resiliency._values import is_int
from lm_resiliency.torchrun.backend import BACKEND_NAME, CONTEXT_OPTION, POLICY_OPTION

_CONF_VALUE = re.compile(r"[^,=\s]+")


@dataclass(frozen=True)
class TorchrunLaunchConfig:
    """The torchrun arguments for `--rdzv-backend=lm_resiliency`.

    `min_nodes` agents train; up to `max_nodes - min_nodes` more park as standbys. `endpoint` is
    the c10d store: a file path with `store_type="file"` (one host), `host:port` with "tcp".
    `restart_context_path` is the node-local context.json (its directory is made owner-only);
    `worker_config` the worker policy TOML that turns on zero-import workers (None: explicit
    `enable_resiliency()` integrations only). `rdzv_conf` adds other `--rdzv-conf` options
    (e.g. `read_timeout`, `join_timeout`)."""

    run_id: str
    endpoint: str
    restart_context_path: str
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 0
    store_type: str = "tcp"
    worker_config: Optional[str] = None
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name = type(self).__name__
        for key in ("min_nodes", "nproc_per_node"):
            if not is_int(getattr(self, key)) or getattr(self, key) < 1:
                raise ValueError(f"{name}.{key}: must be a positive int, got {getattr(self, key)!r}")
        if not is_int(self.max_nodes) or self.max_nodes < self.min_nodes:
            raise ValueError(f"{name}.max_nodes: must be an int >= min_nodes ({self.min_nodes}), "
                             f"got {self.max_nodes!r}")
        if not is_int(self.max_restarts) or self.max_restarts < 0:
            raise ValueError(f"{name}.max_restarts: must be an int >= 0, got {self.max_restarts!r}")
        if self.store_type not in ("file", "tcp"):
            raise ValueError(f"{name}.store_type: must be 'file' (one host) or 'tcp', got {self.store_type!r}")
        if not isinstance(self.run_id, str) or not _CONF_VALUE.fullmatch(self.run_id):
            raise ValueError(f"{name}.run_id: must be a non-empty string without ',', '=' or spaces, got "
                             f"{self.run_id!r}")
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise ValueError(f"{name}.endpoint: must be a non-empty string, got {self.endpoint!r}")
        for key in ("restart_context_path", "worker_config"):
            value = getattr(self, key)
            if value is None and key == "worker_config":
                continue
            if not isinstance(value, str) or not os.path.isabs(value) or not _CONF_VALUE.fullmatch(value):
                raise ValueError(f"{name}.{key}: must be an absolute path without ',', '=' or spaces, got {value!r}")
        reserved = {"store_type", CONTEXT_OPTION, POLICY_OPTION}
        for key, value in self.rdzv_conf.items():
            if key in reserved:
                raise ValueError(f"{name}.rdzv_conf: {key!r} is set by its own field")
            if not (_CONF_VALUE.fullmatch(str(key)) and _CONF_VALUE.fullmatch(str(value))):
                raise ValueError(f"{name}.rdzv_conf: {key!r}={value!r} must not contain ',', '=' or spaces")

    def rdzv_conf_text(self) -> str:
        options = {"store_type": self.store_type, **{str(k): str(v) for k, v in self.rdzv_conf.items()},
                   CONTEXT_OPTION: self.restart_context_path}
        if self.worker_config is not None:
            options[POLICY_OPTION] = self.worker_config
        return ",".join(f"{key}={value}" for key, value in options.items())

    def arguments(self, entry: Sequence[str] = ()) -> List[str]:
        """torchrun's arguments (without the `torchrun` command itself), then `entry`: e.g.
        ["--module", "train", "--lr", "1e-3"] or ["train.py", "--lr", "1e-3"]."""
        return [f"--nnodes={self.min_nodes}:{self.max_nodes}", f"--nproc-per-node={self.nproc_per_node}",
                f"--max-restarts={self.max_restarts}", f"--rdzv-backend={BACKEND_NAME}",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
                f"--rdzv-conf={self.rdzv_conf_text()}", *entry]
