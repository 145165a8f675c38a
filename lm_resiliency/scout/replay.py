"""Replay-based SDC localization: replay one sampled invocation on every equivalent peer, vote.

Per scheduled check (`ReplayHarnessConfig.interval_for`):

1. `arm(step)` before the forward: a forward pre-hook on the sampled module stores the
   invocation's positional and keyword inputs (detached, cloned) on the check's *source* peer,
   then removes itself. Only the source captures, so the other peers pay nothing.
2. `run(step)` after backward, before `optimizer.step()`: the source shares its invocation with
   the group (codec JSON structure + one flat uint8 payload; no pickle). Every peer replays the
   module on those same bytes under `no_grad`, with the RNG forked and seeded identically (so
   dropout matches), and signs the output, the module's parameters, their optimizer state and
   the received input. A bounded slice of one parameter goes through a shadow optimizer step.
   One JSON all-gather exchanges every signature; `vote` decides each check the same way on every
   peer. The source's live output signature joins the vote when it differs from its own replay,
   and a disagreeing vote is checked against a reference replay (`scout.reference`).

The catalog (`ModuleCatalog`) puts every module with parameters in some check class, so one
rotation replays every parameter (`ReplayDetector.coverage`).

FSDP2/HSDP modules are replayed, and their parameters signed, unsharded (`scout.sharded`); a
sharded parameter's optimizer slice is the source's, shared like an invocation. TP modules keep
their DTensor parameters; their collectives line up because every rank runs the same plan.

A faulty device shows up because the replay runs the module's real forward (its hooks included)
on the faulty peer, which then disagrees with the majority. Parameters and live gradients are
never modified; the module's buffers are restored after the replay; the live RNG state is
untouched.

Why one module of this size: arm, share, replay, sign and vote are one collective protocol per
check; every peer must run the same steps in the same order.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency._values import is_int
from lm_resiliency import wire
from lm_resiliency.codec import Layout, StateEncodingError, StateSchemaError, decode_state, encode_state
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import json_copy
from lm_resiliency.scout.backward import OutputGradCapture, grad_leaf, replay_gradients
from lm_resiliency.scout.config import CHECK_CLASSES, ReplayHarnessConfig
from lm_resiliency.scout.invocation import (
    Autocast,
    SeededRng,
    autocast_regions,
    clone_inputs,
    map_tensors,
    module_device,
    preserved_buffers,
    sync_device,
    tensors_in,
    to_device,
)
from lm_resiliency.scout.peers import CLEAN, ERROR, INCONCLUSIVE, SDC, voted_outcome
from lm_resiliency.scout.reference import ReferenceStore
from lm_resiliency.scout.reports import CheckOutcome, ReplayResult
from lm_resiliency.scout.sharded import ShardedReplayError, check_replayable, fsdp_modules_for, unsharded
from lm_resiliency.scout.signature import structure_signature, tensor_signature
from lm_resiliency.wrappers import unwrap_model

logger = logging.getLogger(__name__)

CHECKS = CHECK_CLASSES
ACTIVATION_CHECKS = ("embedding", "hidden", "output")
ERROR_SIGNATURE = "error"
# One replay check of a run's plan: (check, module path or optimizer label, source rank; None: the
# optimizer check has no source to compare against).
PlannedCheck = Tuple[str, str, Optional[int]]
_HEADER_KEYS = {"ok", "step", "check", "module", "structure", "layout", "autocast", "reason", "live"}


class ReplayError(ResiliencyError, RuntimeError):
    """A replay check could not be run (peers disagree on the plan, or on the shared bytes).

    Raised on every peer of the group at the same point, so collectives stay aligned."""


class ReplayUnsupportedError(ResiliencyError, ValueError):
    """The model cannot be replayed by this detector (e.g. a grouped `fully_shard([...])`)."""


@dataclass(frozen=True)
class ModuleCatalog:
    """The modules SCOUT samples, by path inside the (DDP-unwrapped) model."""

    embedding: Optional[Tuple[str, nn.Module]]
    hidden: Tuple[Tuple[str, nn.Module], ...]
    output: Optional[Tuple[str, nn.Module]]
    # Modules owning parameters none of the above holds (a final norm, a positional table on the
    # root): the output check rotates through them after the output module, so every parameter
    # is replayed and signed within one rotation.
    remaining: Tuple[Tuple[str, nn.Module], ...] = ()

    @staticmethod
    def of(model: nn.Module, exclude: Sequence[nn.Module] = ()) -> "ModuleCatalog":
        """`exclude`: modules replayed elsewhere (expert stages, on expert peers); neither they, what
        they hold, nor what holds them is sampled."""
        named = [(path or "(root)", m) for path, m in model.named_modules()]
        if exclude:
            inside = {id(m) for e in exclude for m in e.modules()}
            named = [(p, m) for p, m in named
                     if id(m) not in inside and not any(id(c) in inside for c in m.modules())]
        leaves = [(p, m) for p, m in named
                  if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None]
        embedding = next(((p, m) for p, m in named if isinstance(m, nn.Embedding)), leaves[0] if leaves else None)
        output = leaves[-1] if leaves else None
        hidden: Tuple[Tuple[str, nn.Module], ...] = ()
        for path, container in named:
            if not isinstance(container, (nn.ModuleList, nn.Sequential)):
                continue
            by_type: Dict[type, List[Tuple[str, nn.Module]]] = {}
            for name, child in container.named_children():
                if next(child.parameters(), None) is not None:
                    prefix = "" if path == "(root)" else f"{path}."
                    by_type.setdefault(type(child), []).append((prefix + name, child))
            best = max(by_type.values(), key=len, default=[])
            if len(best) >= 2 and len(best) > len(hidden):
                hidden = tuple(best)
        chosen = ([embedding] if embedding else []) + list(hidden) + ([output] if output else [])
        covered = {id(p) for _, m in chosen for p in m.parameters()}
        remaining = []
        for path, module in named:  # parents first: a parent replayed covers its children too
            if any(id(p) not in covered for p in module.parameters(recurse=False)):
                remaining.append((path, module))
                covered.update(id(p) for p in module.parameters())
        return ModuleCatalog(embedding, hidden, output, tuple(remaining))


def _refuse_compiled(model: nn.Module) -> None:
    """ReplayUnsupportedError when torch.compile runs any part of `model` (`torch.compile(module)`
    or `module.compile()`): the capture hooks a check adds would not fire inside compiled code."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded by every torch.compile
    compiled = [path or "(root)" for path, m in model.named_modules()
                if getattr(m, "_compiled_call_impl", None) is not None
                or (eval_frame is not None and isinstance(m, eval_frame.OptimizedModule))]
    if compiled:
        raise ReplayUnsupportedError(
            f"torch.compile runs {compiled[:4]}: the capture hooks SCOUT adds per check would not fire inside "
            "compiled code, so compiled models are not replayed (GEMINI checkpoints are not certified; the "
            "out-of-band hang and stall monitor stays on)")


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _whole_when_unsharded(param: torch.Tensor, peers: Sequence[int]) -> bool:
    """A plain tensor, or a DTensor whose every mesh dimension runs within the peer group (FSDP
    and HSDP dimensions, which an unshard gathers), not across it (TP)."""
    if not _is_dtensor(param):
        return True
    mesh = param.device_mesh
    return all(set(dist.get_process_group_ranks(mesh.get_group(i))) <= set(peers) for i in range(mesh.ndim))


def _rng_marks(device: torch.device) -> List[torch.Tensor]:
    """The CPU RNG state and, on an accelerator, its device RNG state: equal marks before and
    after a call mean the call drew no random numbers."""
    marks = [torch.get_rng_state()]
    if device.type == "cuda":
        marks.append(torch.cuda.get_rng_state(device))
    return marks


class _Capture:
    """Forward pre-hook that stores one invocation's inputs, then removes itself; for a module
    with a backward replay also that call's output gradient from the real backward (`OutputGradCapture`).

    A forward hook on the same call signs the live output (`live`), which must equal every
    peer's replay: a fault in the live forward alone is caught too. It is left unsigned when the
    call drew random numbers (dropout: the replay reseeds), when inputs are kept by reference, or
    when the pre-hook missed the call (registered while the module's pre-hooks ran); in that
    last case the forward hook captures the inputs instead."""

    def __init__(self, detector: "ReplayDetector", path: str, module: nn.Module, step: int) -> None:
        self.path, self.step = path, step
        self.args: Any = None
        self.kwargs: Any = None
        self.autocast: List[List[str]] = []
        self.done = False
        self.live: Optional[str] = None
        self._rng: Optional[List[torch.Tensor]] = None
        self._detector = detector
        self._handle = module.register_forward_pre_hook(self, with_kwargs=True, prepend=True)
        self._post = module.register_forward_hook(self._after, with_kwargs=True)
        self.output_grads = OutputGradCapture(module, tensors_in) if path in detector._backward else None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.done or self._detector._replaying:
            return None
        self._store(args, kwargs)
        if self._detector.config.capture_inputs_by_value:
            self._rng = _rng_marks(module_device(module))
        self._remove_pre_hook()  # the output-gradient hook stays until this call's output is seen
        return None

    def _store(self, args: tuple, kwargs: dict) -> None:
        by_value = self._detector.config.capture_inputs_by_value
        self.args, self.kwargs = clone_inputs(args, by_value), clone_inputs(kwargs, by_value)
        self.autocast = autocast_regions()
        self.done = True

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._detector._replaying:
            return None
        if not self.done:
            self._store(args, kwargs)
        elif self._rng is not None and all(torch.equal(a, b) for a, b in
                                           zip(self._rng, _rng_marks(module_device(module)))):
            self.live = structure_signature(tensors_in(output))
        self._remove_post_hook()
        return None

    def _remove_pre_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _remove_post_hook(self) -> None:
        if self._post is not None:
            self._post.remove()
            self._post = None

    def remove(self) -> None:
        self._remove_pre_hook()
        self._remove_post_hook()
        if self.output_grads is not None:
            self.output_grads.remove()


class ReplayDetector:
    """Replay sampled layers on equivalent peers and vote on bitwise signatures.

    `group` is a gloo process group holding exactly `group_ranks` (global ranks); every rank of
    the group must call `arm`/`run` for the same steps. With `group=None` the detector runs alone
    (one peer): every check is trivially clean. Call `arm(step)` before the forward of `step` and
    `run(step)` after its backward, before `optimizer.step()`. `step` counts optimizer steps from 1.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: ReplayHarnessConfig, *,
                 group: Optional[dist.ProcessGroup], group_ranks: Sequence[int],
                 exclude: Sequence[nn.Module] = ()) -> None:
        if not isinstance(config, ReplayHarnessConfig):
            raise TypeError(f"config must be a ReplayHarnessConfig, got {type(config).__name__}")
        ranks = list(group_ranks)
        if not ranks or not all(is_int(r) and r >= 0 for r in ranks) \
                or len(set(ranks)) != len(ranks):
            raise ValueError(f"group_ranks must be distinct non-negative ints, got {group_ranks!r}")
        self._rank = dist.get_rank() if dist.is_initialized() else ranks[0]
        if self._rank not in ranks:
            raise ValueError(f"this rank ({self._rank}) is not in group_ranks {ranks}")
        if group is None:
            if len(ranks) != 1:
                raise ValueError(f"group is None but group_ranks has {len(ranks)} ranks; pass the peer group")
        else:
            if not dist.is_initialized():
                raise ValueError("a process group was passed but torch.distributed is not initialized")
            members = dist.get_process_group_ranks(group)
            if sorted(members) != sorted(ranks):
                raise ValueError(f"group holds ranks {sorted(members)} but group_ranks is {ranks}")
            backend = str(dist.get_backend(group))
            if "gloo" not in backend:
                raise ValueError(f"the replay group must be a gloo group (CPU collectives), got backend {backend!r}")
        _refuse_compiled(model)
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.group = group
        self.group_ranks: Tuple[int, ...] = tuple(ranks)
        self.host = socket.gethostname()
        self._root = unwrap_model(model)
        self.catalog = ModuleCatalog.of(self._root, exclude)
        # Parameters of excluded modules differ between these peers (experts): never sampled here.
        self._excluded = {id(p) for m in exclude for p in m.parameters()}
        # FSDP modules to unshard around each sampled module's replay (none for dense and TP-only models).
        self._fsdp: Dict[str, List[nn.Module]] = {}
        self._remaining = self._replayable_remaining()
        # Modules whose parameters are whole on every peer (dense, or FSDP/HSDP once unsharded) also
        # get a backward replay; TP modules do not (their backward would add TP collectives).
        self._backward: set = set()
        for check in ACTIVATION_CHECKS:
            for path, module in self._candidates(check):
                self._fsdp[path] = self._fsdp_owners(path, check)
                params = list(module.parameters())
                if all(_whole_when_unsharded(p, self.group_ranks) for p in params) and \
                        (self._fsdp[path] or not any(_is_dtensor(p) for p in params)):
                    self._backward.add(path)
        self._names = {id(p): name for name, p in self._root.named_parameters()}
        self._captures: Dict[str, _Capture] = {}
        self._armed_step: Optional[int] = None
        self._replaying = False
        self._references = ReferenceStore(config.reference_max_bytes)

    # -- schedule ---------------------------------------------------------------------------

    def _fsdp_owners(self, path: str, what: str) -> List[nn.Module]:
        owners = fsdp_modules_for(self._root, path)
        try:
            check_replayable(owners, path)
        except ShardedReplayError as exc:
            raise ReplayUnsupportedError(f"{what} module {path!r}: {exc}") from exc
        return owners

    def _replayable_remaining(self) -> Tuple[Tuple[str, nn.Module], ...]:
        """The catalog's remaining modules that can be replayed; one that cannot (e.g. inside a
        grouped `fully_shard`) is left out of the rotation, and `coverage()` counts it missing."""
        kept = []
        for path, module in self.catalog.remaining:
            try:
                self._fsdp_owners(path, "remaining")
            except ReplayUnsupportedError as exc:
                logger.warning("SCOUT: %r is left out of the replay rotation: %s", path, exc)
                continue
            kept.append((path, module))
        return tuple(kept)

    def _candidates(self, check: str) -> Tuple[Tuple[str, nn.Module], ...]:
        if check == "embedding":
            return (self.catalog.embedding,) if self.catalog.embedding else ()
        if check == "output":
            return ((self.catalog.output,) if self.catalog.output else ()) + self._remaining
        if check == "hidden":
            return self.catalog.hidden
        raise ValueError(f"unknown activation check {check!r}")

    def _optimizer_params(self) -> List[Tuple[int, torch.Tensor]]:
        seen, out = set(), []
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in seen and id(p) not in self._excluded:
                    seen.add(id(p))
                    out.append((index, p))
        return out

    def _available(self, check: str) -> bool:
        if check == "optimizer":
            return bool(self._optimizer_params())
        return bool(self._candidates(check))

    def checks_due(self, step: int) -> List[str]:
        """The check classes scheduled at optimizer step `step` (counted from 1)."""
        _check_step(step)
        return [c for c in CHECKS if self.config.due(c, step) and self._available(c)]

    def _round(self, check: str, step: int) -> int:
        """How many times `check` has been scheduled up to `step` (1 at its first check)."""
        return step // self.config.interval_for(check)

    def _rotates(self, check: str) -> bool:
        """`rotate_layers` governs the hidden layers; the output check always rotates through
        the remaining modules (without it they would never be replayed)."""
        return check == "output" or (check == "hidden" and self.config.rotate_layers)

    def _target(self, check: str, step: int) -> Tuple[str, nn.Module]:
        candidates = self._candidates(check)
        if self._rotates(check):
            return candidates[(self._round(check, step) - 1) % len(candidates)]
        return candidates[0]

    def coverage(self) -> Dict[str, Any]:
        """What one full rotation of the activation checks replays and signs (parameters and,
        for unsharded parameters, their optimizer state):

        `parameters` / `bytes`: fraction of the model's parameters by count / by bytes that some
        rotated module holds; `checks`: how many checks of the longest rotation cover them all;
        `steps`: optimizer steps that takes (each class at its own interval); `uncovered`:
        names of parameters no check reaches."""
        rotations = {c: (self._candidates(c) if self._rotates(c) else self._candidates(c)[:1])
                     for c in ACTIVATION_CHECKS if self.config.interval_for(c) > 0}   # a class at 0 is off
        covered = {id(p) for modules in rotations.values() for _, m in modules for p in m.parameters()}
        params = list(self._root.named_parameters())
        total_bytes = sum(_local(p).numel() * p.element_size() for _, p in params)
        seen_bytes = sum(_local(p).numel() * p.element_size() for _, p in params if id(p) in covered)
        checks = max((len(m) for m in rotations.values()), default=0)
        return {"parameters": sum(id(p) in covered for _, p in params) / len(params) if params else 1.0,
                "bytes": seen_bytes / total_bytes if total_bytes else 1.0,
                "checks": checks,
                "steps": max((len(m) * self.config.interval_for(c) for c, m in rotations.items()), default=0),
                "uncovered": [name for name, p in params if id(p) not in covered]}

    def _source(self, check: str, step: int) -> int:
        return self.group_ranks[self._round(check, step) % len(self.group_ranks)]

    def sampled(self, check: str, step: int) -> Tuple[str, Any]:
        """What `check` examines at `step`: (module path, module) for an activation check,
        (parameter slice label, parameter) for the optimizer check. Deterministic on every peer."""
        _check_step(step)
        if check == "optimizer":
            label, param = self._optimizer_target(step)[:2]
            return label, param
        if not self._candidates(check):
            raise ValueError(f"the model has no module for the {check!r} check")
        return self._target(check, step)

    def source(self, check: str, step: int) -> int:
        """The global rank whose captured invocation every peer replays for `check` at `step`."""
        return self._source(check, step)

    # -- capture ----------------------------------------------------------------------------

    def arm(self, step: int) -> None:
        """Install capture hooks for the checks due at `step` (call before its forward)."""
        self._remove_captures()
        self._captures, self._armed_step = {}, step
        for check in self.checks_due(step):
            if check == "optimizer" or self._source(check, step) != self._rank:
                continue
            path, module = self._target(check, step)
            if path not in self._captures:
                self._captures[path] = _Capture(self, path, module, step)

    def _remove_captures(self) -> None:
        for capture in self._captures.values():
            capture.remove()

    def close(self) -> None:
        """Remove every hook this detector installed and drop captured inputs."""
        self._remove_captures()
        self._captures = {}
        self._armed_step = None

    # -- replay -----------------------------------------------------------------------------

    def run(self, step: int) -> ReplayResult:
        """Replay and vote every check due at `step`. Collective over the group.

        Collectives: one JSON all-gather agreeing on the plan (and carrying the sources'
        invocation headers), one uint8 broadcast per source (all of its activation checks, and
        the optimizer check of a sharded parameter), one JSON all-gather of the signatures; with
        FSDP, the unshard all-gathers over the FSDP mesh; after a disagreeing forward vote, one
        JSON all-gather of the reference replays' results. Raises `ReplayError` on every peer when
        the peers' plans differ; a check that fails on every peer is an "error" outcome."""
        _check_step(step)
        self._remove_captures()
        captures = self._captures if self._armed_step == step else {}
        self._captures, self._armed_step = {}, None
        due = self.checks_due(step)
        activation = [c for c in due if c != "optimizer"]
        plan: List[PlannedCheck] = [(c, self._target(c, step)[0], self._source(c, step)) for c in activation]
        if "optimizer" in due:
            plan.append(("optimizer", self._optimizer_target(step)[0], self._optimizer_source(step)))
        headers: Dict[str, dict] = {}
        outgoing: Dict[str, List[torch.Tensor]] = {}
        for check, path, source in plan:
            if source == self._rank:
                headers[check], outgoing[check] = self._encode_optimizer_slice(step, path) \
                    if check == "optimizer" else self._encode_capture(check, path, step, captures.get(path))
        agreed = self._agree(step, plan, headers)
        payloads = self._receive(step, plan, agreed, outgoing)
        local: List[dict] = []
        optimizer_doc = None
        for check, path, source in plan:
            if source is None:  # only the optimizer check can have no source: nothing to compare
                optimizer_doc = self._optimizer_check(step, None)
                continue
            header, payload = agreed[source][check], payloads[check]
            if check == "optimizer":
                optimizer_doc = self._optimizer_check(step, (header, payload))
            else:
                entry = self._replay_one(check, path, self._target(check, step)[1], step, header, payload)
                entry["live"] = [source, header["live"]] if header.get("live") else None
                local.append(entry)
        doc = {"rank": self._rank, "host": self.host, "step": step, "checks": local, "optimizer": optimizer_doc}
        docs = self._gather(doc)
        return ReplayResult(step=step, checks=tuple(self._decide(step, docs)))

    def _encode_capture(self, check: str, path: str, step: int,
                        capture: Optional[_Capture]) -> Tuple[dict, List[torch.Tensor]]:
        """On the source: the captured invocation as (JSON header, tensor leaves). No pickle."""
        header: dict = {"ok": False, "step": step, "check": check, "module": path}
        if capture is None:
            header["reason"] = f"arm({step}) was not called on source rank {self._rank} before the forward"
            return header, []
        if not capture.done:
            header["reason"] = f"{path!r} was not called between arm({step}) and run({step}) on rank {self._rank}"
            return header, []
        invocation = {"args": capture.args, "kwargs": capture.kwargs}
        if capture.output_grads is not None and capture.output_grads.captured:
            invocation["grad_outputs"] = capture.output_grads.grads
        try:
            encoded = encode_state(invocation)
            layout = Layout.for_tensors(encoded.tensors)
        except StateEncodingError as exc:
            header["reason"] = f"inputs of {path!r} cannot be shared without pickle: {exc}"
            return header, []
        header.update(ok=True, structure=encoded.structure, layout=layout.to_json(), autocast=capture.autocast,
                      live=capture.live)
        return header, encoded.tensors

    def _agree(self, step: int, plan: List[PlannedCheck], headers: Dict[str, dict]) -> Dict[int, Dict[str, dict]]:
        """Every peer's headers by rank, after checking that every peer runs the same plan."""
        doc = {"rank": self._rank, "step": step, "plan": [list(check) for check in plan], "headers": headers}
        docs = [doc] if self.group is None else wire.all_gather_json(doc, group=self.group)
        by_rank = {d["rank"]: d for d in docs if isinstance(d, dict) and is_int(d.get("rank"))}
        if set(by_rank) != set(self.group_ranks) or len(docs) != len(self.group_ranks):
            raise ReplayError(f"step {step}: replay plans came from ranks {sorted(map(str, by_rank))}, "
                              f"expected {sorted(self.group_ranks)}")
        mine = json_roundtrip([step, plan])
        for rank, d in by_rank.items():
            if [d.get("step"), d.get("plan")] != mine:
                raise ReplayError(f"step {step}: peers disagree on the replay plan: rank {self._rank} has "
                                  f"{mine}, rank {rank} has {[d.get('step'), d.get('plan')]} "
                                  "(same ReplayHarnessConfig, model and optimizer on every peer?)")
            if not isinstance(d.get("headers"), dict):
                raise ReplayError(f"step {step}: rank {rank} sent malformed invocation headers")
        return {rank: d["headers"] for rank, d in by_rank.items()}

    def _receive(self, step: int, plan: List[PlannedCheck], agreed: Dict[int, Dict[str, dict]],
                 outgoing: Dict[str, List[torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """Every shared invocation's flat payload on every peer, by check: one uint8 broadcast per
        source, carrying all of that source's checks back to back (checks due together share a
        source when their intervals are equal)."""
        layouts: Dict[str, Layout] = {}
        by_source: Dict[int, List[str]] = {}
        for check, path, source in plan:
            if source is None:
                continue
            header = agreed[source].get(check)
            if not isinstance(header, dict) or not set(header) <= _HEADER_KEYS or \
                    (header.get("step"), header.get("check"), header.get("module")) != (step, check, path):
                raise ReplayError(f"step {step} {check} check: source rank {source} sent no valid header "
                                  f"for {path!r}")
            try:
                layouts[check] = Layout.from_json(header.get("layout")) if header.get("ok") else Layout((), 0)
            except StateSchemaError as exc:
                raise ReplayError(f"step {step} {check} check: bad invocation layout from rank {source}: "
                                  f"{exc}") from exc
            by_source.setdefault(source, []).append(check)
        payloads: Dict[str, torch.Tensor] = {}
        for source, checks in by_source.items():
            buffer = torch.empty(sum(layouts[c].total_bytes for c in checks), dtype=torch.uint8)
            offset = 0
            for check in checks:
                payloads[check] = buffer.narrow(0, offset, layouts[check].total_bytes)
                offset += layouts[check].total_bytes
                if source == self._rank:
                    for view, t in zip(layouts[check].views(payloads[check]), outgoing.get(check, [])):
                        view.copy_(t.reshape(view.shape))
            if self.group is not None and buffer.numel():
                dist.broadcast(buffer, src=source, group=self.group)
        return payloads

    def _replay_one(self, check: str, path: str, module: nn.Module, step: int, header: dict,
                    payload: torch.Tensor) -> dict:
        entry: Dict[str, Any] = {"check": check, "module": path, "params": None, "skipped": None, "input": None,
                                 "out": None, "time": None, "error": None, "state": self._state_signature(module)}
        try:
            # Unsharded on every peer, skipped checks included, so the FSDP all-gathers line up.
            with unsharded(self._fsdp.get(path, [])):
                entry["params"] = structure_signature(list(module.parameters()))
                if not header.get("ok"):
                    entry["skipped"] = str(header.get("reason", "no capture"))
                    return entry
                if not self._fsdp.get(path) and not any(_is_dtensor(p) for p in module.parameters()):
                    self._references.stage(path, step, header, payload, module)
                self._replay_on(check, path, module, step, header, payload, entry)
        except ShardedReplayError as exc:
            # FSDP state is the same on every rank, so every peer raises here together.
            raise ReplayError(f"step {step} {check} check on {path!r}: {exc}") from exc
        return entry

    def _state_signature(self, module: nn.Module) -> Optional[str]:
        """Signature of the optimizer state of `module`'s replicated parameters (None without
        any). A sharded parameter's state differs per peer by design and is left out."""
        leaves: List[Optional[torch.Tensor]] = []
        for param in module.parameters():
            state = self.optimizer.state.get(param) if not _is_dtensor(param) else None
            if state is None:
                continue
            for key in sorted(state, key=str):
                leaves.append(_state_leaf(state[key]))
        return structure_signature(leaves) if leaves else None

    def _replay_on(self, check: str, path: str, module: nn.Module, step: int, header: dict,
                   payload: torch.Tensor, entry: Dict[str, Any]) -> None:
        device = module_device(module)
        try:
            layout = Layout.from_json(header["layout"])
            received = layout.views(payload)
            entry["input"] = structure_signature(received)
            # Every peer, the source included, replays the same received bytes.
            invocation = decode_state(header["structure"], list(received))
            if not isinstance(invocation, dict) or not {"args", "kwargs"} <= set(invocation) <= \
                    {"args", "kwargs", "grad_outputs"} or not isinstance(invocation["args"], (tuple, list)) \
                    or not isinstance(invocation["kwargs"], dict) \
                    or not isinstance(invocation.get("grad_outputs", []), (tuple, list)):
                raise StateSchemaError("the shared invocation must be {'args': tuple, 'kwargs': dict[, "
                                       "'grad_outputs': list]}")
        except (StateSchemaError, KeyError) as exc:
            # The header is identical on every peer, so every peer raises here together.
            raise ReplayError(f"step {step} {check} check on {path!r}: malformed shared invocation: {exc}") from exc
        # The source shared an output gradient: the same forward, with grad, then a backward.
        backward = "grad_outputs" in invocation and path in self._backward and \
            not any(_is_dtensor(p) for p in module.parameters())
        try:
            args, kwargs = to_device(invocation["args"], device), to_device(invocation["kwargs"], device)
            leaves: List[torch.Tensor] = []
            self._replaying = True
            try:
                with preserved_buffers(module), torch.set_grad_enabled(backward), \
                        SeededRng(self.config.seed + step, device), Autocast(header.get("autocast")):
                    if backward:
                        args, kwargs = map_tensors((args, kwargs), lambda t: grad_leaf(t, leaves))
                    sync_device(device)
                    begin = time.perf_counter()
                    out = module(*args, **kwargs)
                    sync_device(device)
                    entry["time"] = time.perf_counter() - begin
            finally:
                self._replaying = False
            entry["out"] = structure_signature(tensors_in(out))
        except Exception as exc:  # noqa: BLE001 - a failing replay is evidence, decided by the vote
            logger.warning("SCOUT replay of %s (%s) failed on rank %d: %s", path, check, self._rank, exc)
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
            backward = False
        if backward:
            self._replay_backward(check, path, module, out, invocation["grad_outputs"], leaves, entry)

    def _replay_backward(self, check: str, path: str, module: nn.Module, out: Any, grad_outputs: list,
                         leaves: List[torch.Tensor], entry: Dict[str, Any]) -> None:
        try:
            grads = replay_gradients(tensors_in(out), to_device(list(grad_outputs), module_device(module)),
                                     leaves, list(module.parameters()))
            entry["backward"] = structure_signature(grads)
        except Exception as exc:  # noqa: BLE001 - a failing backward replay is evidence, decided by the vote
            logger.warning("SCOUT backward replay of %s (%s) failed on rank %d: %s", path, check, self._rank, exc)
            entry["backward"] = ERROR_SIGNATURE

    def _optimizer_target(self, step: int) -> Tuple[str, torch.Tensor, int, int, int]:
        """(slice label, parameter, param-group index, slice start, slice width) checked at `step`.

        Rotates through the optimizer's parameters, then through slices of each. A DTensor's
        slice is of this rank's local shard; only the source's is used (`_optimizer_source`)."""
        params = self._optimizer_params()
        k = self._round("optimizer", step) - 1
        position = k % len(params)
        index, param = params[position]
        name = self._names.get(id(param), f"optimizer_params[{position}]")
        numel = _local(param).numel()
        width = min(numel, self.config.optimizer_check_max_elements)
        start = min(((k // len(params)) * width) % max(numel, 1), numel - width)
        if _is_dtensor(param):
            return f"{name}[local shard of rank {self._source('optimizer', step)}]", param, index, start, width
        return f"{name}[{start}:{start + width}]", param, index, start, width

    def _optimizer_source(self, step: int) -> Optional[int]:
        """The peer whose slice everyone steps: a sharded parameter's slice is unique to each
        rank, so the source shares its own; replicated parameters are stepped where they are."""
        return self._source("optimizer", step) if _is_dtensor(self._optimizer_target(step)[1]) else None

    def _optimizer_slice(self, step: int) -> dict:
        """This rank's bounded slice of the sampled parameter: values, gradient, optimizer state."""
        _, param, _, start, width = self._optimizer_target(step)
        local = _local(param)
        grad = param.grad
        if grad is not None and grad.layout != torch.strided:
            raise ReplayUnsupportedError(f"{grad.layout} gradients are not supported")
        if local.dim() == 0:  # a scalar steps as itself: slicing would turn it (not its state) into [1]
            return {"param": local.detach().clone(), "grad": None if grad is None else _local(grad).detach().clone(),
                    "state": {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                              for k, v in self.optimizer.state.get(param, {}).items()}}
        state = {}
        for key, value in self.optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                value = _local(value).detach()
                sliced = value.dim() > 0 and value.shape == local.shape
                state[key] = value.reshape(-1)[start:start + width].clone() if sliced else value.clone()
            else:
                state[key] = copy.deepcopy(value)
        return {"param": local.detach().reshape(-1)[start:start + width].clone(),
                "grad": None if grad is None else _local(grad).detach().reshape(-1)[start:start + width].clone(),
                "state": state}

    def _encode_optimizer_slice(self, step: int, label: str) -> Tuple[dict, List[torch.Tensor]]:
        """On the source of a sharded parameter's check: its slice as (JSON header, tensor leaves)."""
        header: dict = {"ok": False, "step": step, "check": "optimizer", "module": label}
        try:
            encoded = encode_state(self._optimizer_slice(step))
            layout = Layout.for_tensors(encoded.tensors)
        except (StateEncodingError, ReplayUnsupportedError) as exc:
            header["reason"] = f"the optimizer slice {label!r} cannot be shared: {exc}"
            return header, []
        header.update(ok=True, structure=encoded.structure, layout=layout.to_json())
        return header, encoded.tensors

    def _parameter_signature(self, name: str, param: torch.Tensor) -> str:
        """Signature of the parameter every peer holds alike: FSDP-sharded parameters unsharded
        (collective over the FSDP mesh), TP parameters by their local TP shard."""
        if not _is_dtensor(param):
            return tensor_signature(param)
        owner = name.rpartition(".")[0] or "(root)"
        try:
            with unsharded(self._fsdp_owners(owner, "optimizer")):
                return tensor_signature(self._root.get_parameter(name))
        except (ReplayUnsupportedError, ShardedReplayError) as exc:
            # The FSDP layout is the same on every rank, so every peer raises here together.
            raise ReplayError(f"optimizer check of {name!r}: {exc}") from exc

    def _shared_slice(self, step: int, label: str, shared: Tuple[dict, torch.Tensor]) -> dict:
        header, payload = shared
        if not header.get("ok"):
            raise ReplayUnsupportedError(str(header.get("reason", "the source shared no slice")))
        try:
            leaves = Layout.from_json(header["layout"]).views(payload)
            inputs = decode_state(header["structure"], list(leaves))
        except (StateSchemaError, KeyError) as exc:
            raise ReplayError(f"step {step} optimizer check of {label!r}: malformed shared slice: {exc}") from exc
        if not isinstance(inputs, dict) or set(inputs) != {"param", "grad", "state"}:
            raise ReplayError(f"step {step} optimizer check of {label!r}: the shared slice must be "
                              "{'param', 'grad', 'state'}")
        return inputs

    def _optimizer_check(self, step: int, shared: Optional[Tuple[dict, torch.Tensor]]) -> dict:
        """Step a shadow optimizer on the sampled slice: this rank's own (replicated parameter)
        or the source's `shared` bytes (sharded parameter), and sign the result."""
        label, param, index, _, _ = self._optimizer_target(step)
        name = label[:label.rindex("[")]
        entry: Dict[str, Any] = {"check": "optimizer", "param": name, "module": label,
                                 "params": self._parameter_signature(name, param), "out": None, "time": None,
                                 "error": None}
        device = _local(param).device
        try:
            inputs = self._optimizer_slice(step) if shared is None else \
                to_device(self._shared_slice(step, label, shared), device)
            shadow = nn.Parameter(inputs["param"])
            shadow.grad = inputs["grad"]
            hyper = {key: value for key, value in self.optimizer.param_groups[index].items() if key != "params"}
            shadow_optimizer = _shadow_optimizer(self.optimizer, shadow, hyper)
            if inputs["state"]:
                shadow_optimizer.state[shadow] = inputs["state"]
            with SeededRng(self.config.seed + step, device):
                sync_device(device)
                begin = time.perf_counter()
                shadow_optimizer.step()
                sync_device(device)
                entry["time"] = time.perf_counter() - begin
            new_state = shadow_optimizer.state.get(shadow, {})
            leaves = [shadow.detach()]
            for key in sorted(new_state, key=str):
                leaves.append(_state_leaf(new_state[key]))
            entry["out"] = structure_signature(leaves)
        except ReplayError:
            raise
        except Exception as exc:  # noqa: BLE001 - decided by the vote (every peer failing raises)
            logger.warning("SCOUT optimizer check of %s failed on rank %d: %s", name, self._rank, exc)
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        return entry

    # -- agreement --------------------------------------------------------------------------

    def _gather(self, doc: dict) -> List[dict]:
        if self.group is None:
            return [doc]
        return wire.all_gather_json(doc, group=self.group)

    def _decide(self, step: int, docs: List[dict]) -> List[CheckOutcome]:
        by_rank = {d.get("rank"): d for d in docs if isinstance(d, dict)}
        if set(by_rank) != set(self.group_ranks) or len(docs) != len(self.group_ranks):
            raise ReplayError(f"step {step}: replay results came from ranks {sorted(map(str, by_rank))}, "
                              f"expected {sorted(self.group_ranks)}")

        def plan(d: dict) -> list:
            opt = d.get("optimizer")
            return [d.get("step"), [(c.get("check"), c.get("module"), bool(c.get("skipped"))) for c in d["checks"]],
                    None if opt is None else (opt.get("param"), opt.get("module"))]

        reference = plan(by_rank[self.group_ranks[0]])
        for rank, d in by_rank.items():
            if plan(d) != reference:
                raise ReplayError(f"step {step}: peers disagree on the replay plan: rank {self.group_ranks[0]} "
                                  f"{reference} vs rank {rank} {plan(d)} (same config and model on every peer?)")
        ranks = self.group_ranks
        hosts = {r: str(by_rank[r].get("host", "")) for r in ranks}
        outcomes: List[CheckOutcome] = []
        param_paths = set()

        def outcome(check: str, path: str, signatures: Dict[int, str], timings: Dict[int, float]) -> CheckOutcome:
            return voted_outcome(check, path, ranks, signatures, f"replay check at step {step}", hosts=hosts,
                                 timings=timings)

        def voted(check: str, path: str, entries: Dict[int, dict], timings: Dict[int, float]) -> CheckOutcome:
            if all(e.get("error") for e in entries.values()):
                # The same failure on every peer is SCOUT's own (an unsupported module or state),
                # not evidence about any device: an error outcome, never an SDC verdict.
                detail = f"{check} check of {path!r} failed on every peer: " + \
                    "; ".join(f"rank {r}: {e['error']}" for r, e in entries.items())
                logger.error("SCOUT replay check at step %d: %s", step, detail)
                return CheckOutcome(check=check, module_path=path, group_ranks=tuple(ranks),
                                    signatures={r: ERROR_SIGNATURE for r in ranks}, verdict=ERROR,
                                    hosts=hosts, detail=detail)
            signatures = {r: ERROR_SIGNATURE if e.get("error") else str(e["out"]) for r, e in entries.items()}
            return outcome(check, path, signatures, timings)

        def with_state(path: str, entries: Dict[int, dict]) -> None:
            outcomes.append(outcome("parameters", path, {r: str(e["params"]) for r, e in entries.items()}, {}))
            if any(e.get("state") is not None for e in entries.values()):
                outcomes.append(outcome("optimizer_state", path, {r: str(e.get("state")) for r, e in entries.items()},
                                        {}))

        for i, first in enumerate(by_rank[ranks[0]]["checks"]):
            entries = {r: by_rank[r]["checks"][i] for r in ranks}
            check, path = first["check"], first["module"]
            if path not in param_paths:
                param_paths.add(path)
                with_state(path, entries)
            if first.get("skipped"):
                logger.warning("SCOUT %s check on %s at step %d skipped: %s", check, path, step, first["skipped"])
                continue
            inputs = {r: str(e.get("input")) for r, e in entries.items()}
            if len(set(inputs.values())) > 1:
                outcomes.append(outcome("input", path, inputs, {}))
            timings = {r: float(e["time"]) for r, e in entries.items() if e.get("time") is not None}
            forward = voted(check, path, entries, timings)
            if forward.verdict == CLEAN:
                self._references.promote(path, forward.signatures[ranks[0]])
            elif forward.verdict in (SDC, INCONCLUSIVE) and len(ranks) >= 3:
                forward = self._tie_break(step, check, path, forward)
            outcomes.append(forward)
            live = first.get("live")
            if forward.verdict != ERROR and live is not None and live[0] in entries \
                    and live[1] != forward.signatures[live[0]]:
                # The source's live output differs from its own replay: its live forward joins the
                # vote in place of that replay.
                outcomes.append(outcome("live", path, {**forward.signatures, live[0]: str(live[1])}, {}))
            backward = {r: str(e.get("backward") or ERROR_SIGNATURE) for r, e in entries.items()}
            # Backward gradients are comparable only where the recomputed forwards agreed; a forward
            # fault already names its rank and would differ in the backward as well.
            if forward.verdict == CLEAN and any(e.get("backward") for e in entries.values()):
                if set(backward.values()) == {ERROR_SIGNATURE}:
                    logger.warning("SCOUT backward replay of %s at step %d failed on every peer", path, step)
                else:
                    outcomes.append(outcome("backward", path, backward, {}))
        if by_rank[ranks[0]].get("optimizer") is not None:
            entries = {r: by_rank[r]["optimizer"] for r in ranks}
            first = entries[ranks[0]]
            if first["param"] not in param_paths:
                param_paths.add(first["param"])
                outcomes.append(outcome("parameters", first["param"],
                                        {r: str(e["params"]) for r, e in entries.items()}, {}))
            timings = {r: float(e["time"]) for r, e in entries.items() if e.get("time") is not None}
            outcomes.append(voted("optimizer", first["module"], entries, timings))
        self._references.discard_pending()
        return outcomes

    def _tie_break(self, step: int, check: str, path: str, forward: CheckOutcome) -> CheckOutcome:
        """Every peer reruns its reference of `path` (collective; the verdict that calls it is
        the same on every peer). Peers that fail it while others pass are faulty now: the vote
        stands when it named exactly them, and is inconclusive otherwise (a majority faulty alike
        would otherwise name the healthy minority)."""
        ref = self._references.get(path)
        passed = None
        if ref is not None:
            self._replaying = True
            try:
                passed = self._references.self_test(ref, dict(self._candidates(check))[path], self.config.seed)
            finally:
                self._replaying = False
        docs = self._gather({"rank": self._rank, "ref_step": None if ref is None else ref.step, "passed": passed})
        by_rank = {d.get("rank"): d for d in docs if isinstance(d, dict)}
        ref_steps = {by_rank.get(r, {}).get("ref_step") for r in self.group_ranks}
        if len(ref_steps) != 1 or None in ref_steps:
            return forward
        failed = tuple(sorted(r for r in self.group_ranks if by_rank[r].get("passed") is not True))
        if not failed or len(failed) == len(self.group_ranks) or failed == forward.faulty:
            return forward
        detail = (f"ranks {list(failed)} no longer reproduce the step-{ref_steps.pop()} replay every peer agreed "
                  f"on, while the vote named {list(forward.faulty)}: not localized")
        logger.warning("SCOUT replay check at step %d, %s of %s: %s", step, check, path, detail)
        return dataclasses.replace(forward, verdict=INCONCLUSIVE, faulty=(), detail=detail)


def _state_leaf(value: Any) -> Optional[torch.Tensor]:
    """One optimizer-state value as a signable tensor (a number as float64; other values: None)."""
    if isinstance(value, torch.Tensor):
        return _local(value).detach()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor([float(value)], dtype=torch.float64)
    return None


def json_roundtrip(value: Any) -> Any:
    """`value` as every peer sees it after a JSON exchange (tuples become lists)."""
    return json_copy(value)


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step must be a positive int (optimizer steps counted from 1), got {step!r}")


def _shadow_optimizer(live: torch.optim.Optimizer, shadow: nn.Parameter, hyper: dict) -> torch.optim.Optimizer:
    """An optimizer of `live`'s class over `shadow` alone, with the sampled group's hyperparameters."""
    cls = type(live)
    group = dict(hyper, params=[shadow])
    try:
        return cls([group], **dict(live.defaults))
    except TypeError:
        return cls([group])
