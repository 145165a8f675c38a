"""What a torchrun worker knows about its generation (`get_torchrun_worker_context`) and the
worker-adapter contract custom stacks implement."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Protocol

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.binding import RoundBinding
from lm_resiliency.torchrun.context import CONTEXT_ENV

CHECKPOINT_STEP_ENV = "LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"
BOOTSTRAP_ENV = "LM_RESILIENCY_TORCHRUN_BOOTSTRAPPED"


class TorchrunWorkerAdapterError(ResiliencyError, RuntimeError):
    """A torchrun worker cannot attach safely (ambiguous objects, wrong generation, bad policy)."""


@dataclass(frozen=True, kw_only=True)
class TorchrunWorkerContext(ctx.RestartContext):
    """This worker's generation: run identity, launch, hashed node id, local rank and width,
    generation, logical node slot, node count, topology digest, policy digest and the checkpoint
    the rendezvous selected for it (`checkpoint_source` "none": start fresh; "gemini": load exactly
    `checkpoint_step`), and why (`decision`, `reason`)."""

    local_rank: int
    local_world_size: int
    context_path: str

    @property
    def binding(self) -> RoundBinding:
        """What this worker's records are bound to."""
        return RoundBinding(run_id=self.run_id, launch_id=self.launch_id, node_id=self.node_id,
                            generation=self.generation, nodes=self.nodes, nproc_per_node=self.local_world_size)


class TorchrunWorkerAdapter(Protocol):
    """A custom stack's worker adapter (`adapter = "package.module:factory"` in the worker policy):
    the factory receives the TorchrunWorkerContext and returns an object with install(context)."""

    def install(self, context: TorchrunWorkerContext) -> None: ...


def _env_int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "")
    if not (text.isascii() and text.isdigit()):
        raise TorchrunWorkerAdapterError(f"{name}={text!r}: expected the non-negative integer torchrun sets")
    return int(text)


def load_worker_context(environ: Optional[Mapping[str, str]] = None) -> TorchrunWorkerContext:
    """Read and check this worker's restart context (fails closed on any mismatch with the
    environment torchrun gave the worker)."""
    env = os.environ if environ is None else environ
    path = env.get(CONTEXT_ENV)
    if not path:
        raise TorchrunWorkerAdapterError(f"{CONTEXT_ENV} is not set: this process was not started by a torchrun "
                                         "agent with --rdzv-backend=lm_resiliency")
    try:
        context = ctx.checked_context(path, env)
    except ctx.ContextError as exc:
        raise TorchrunWorkerAdapterError(str(exc)) from None
    group_rank = _env_int(env, "GROUP_RANK")
    if group_rank != context.slot:
        raise TorchrunWorkerAdapterError(f"restart context {path} is for node slot {context.slot}, torchrun started "
                                         f"this worker in slot {group_rank}")
    local_world_size = _env_int(env, "LOCAL_WORLD_SIZE")
    world_size = _env_int(env, "WORLD_SIZE")
    if world_size != context.nodes * local_world_size:
        raise TorchrunWorkerAdapterError(f"WORLD_SIZE={world_size} is not {context.nodes} nodes x LOCAL_WORLD_SIZE="
                                         f"{local_world_size}: the generation's topology changed")
    if context.nproc_per_node is not None and context.nproc_per_node != local_world_size:
        raise TorchrunWorkerAdapterError(f"restart context {path} is for --nproc-per-node {context.nproc_per_node}, "
                                         f"torchrun started this worker with LOCAL_WORLD_SIZE={local_world_size}")
    values = {f.name: getattr(context, f.name) for f in dataclasses.fields(context)}
    return TorchrunWorkerContext(**values, local_rank=_env_int(env, "LOCAL_RANK"), local_world_size=local_world_size,
                                 context_path=path)


# Called when user code asks for its context: the bootstrap's guard then knows the script reads
# the step it resumes from (lm_resiliency.recovered_state.EarlyLoads).
CONTEXT_READERS: List[Callable[[], None]] = []


def get_torchrun_worker_context() -> TorchrunWorkerContext:
    """This torchrun worker's context under `--rdzv-backend=lm_resiliency` (also for explicit
    `enable_resiliency()` integrations). Raises TorchrunWorkerAdapterError elsewhere."""
    for note in CONTEXT_READERS:
        note()
    return load_worker_context()
