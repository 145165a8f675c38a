"""Full-catalog replay sweep: the evidence `prepare_recovery("hang"|"uncertain")` decides on.

Recording. At every scheduled SCOUT check step a forward pre-hook on the root model (the
DDP-unwrapped module) keeps that forward's inputs (detached clones) and removes itself; only the
newest recording is kept. Cost: one copy of the batch per check step.

Sweep. Collective among the ranks of each equivalent-peer group that call it, over the c10d
*store*, never the training process group (a hang may have made that group unusable). Keys are
unique per session and call, and every wait is bounded by `full_sweep_timeout_s`:

1. every peer publishes `ready/<rank>` (its optimizer step and the step of its newest recording);
2. the peer with the newest recording (lowest rank on ties) publishes it (codec JSON structure plus
   the raw tensor bytes; no pickle);
3. every peer replays the whole model forward on those bytes under `no_grad`, with the RNG seeded
   identically, temporary forward hooks signing the output of every catalog module (embedding,
   every hidden layer, output and the output rotation's remaining modules) and signatures of
   each catalog module's parameters; buffers and train/eval flags are restored afterwards; it
   publishes `signatures/<rank>`;
4. every peer votes per module (`peers.vote`) on the same documents.

Outcome: CLEAN (every module agreed bitwise), SDC (localized ranks and modules in the result),
INCOMPLETE (a peer did not answer in time, a replay raised, or the vote had no strict majority),
NOT_RUN (no recording in the group, no equivalent peer, or the recording cannot be shared).
Calls are matched by their order in the session. A rank that skips a call is out of step with its
peers' later calls, which come back INCOMPLETE; its own next call reads the peers' answers to the
call it skipped (INCOMPLETE when their optimizer step differs). The last peer to finish a call
deletes its keys; a call that some peer never finished keeps them (one batch per such call).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency._torch_compat import default_store
from lm_resiliency.codec import Layout, StateEncodingError, StateSchemaError, decode_state, encode_state
from lm_resiliency.files import (Field, RecordRejected, RecordSchema, any_json, array, boolean, integer, nullable,
                                 parse_record, text)
from lm_resiliency.recovery import SweepOutcome
from lm_resiliency.scout.peers import CLEAN, voted_outcome
from lm_resiliency.scout.invocation import (
    Autocast,
    SeededRng,
    autocast_regions,
    clone_inputs,
    module_device,
    preserved_buffers,
    tensors_in,
    to_device,
)
from lm_resiliency.scout.replay import ModuleCatalog, ReplayDetector
from lm_resiliency.wrappers import unwrap_model
from lm_resiliency.scout.reports import ReplayResult
from lm_resiliency.scout.signature import structure_signature
from lm_resiliency.tensor_bytes import tensor_bytes

logger = logging.getLogger(__name__)

STORE_PREFIX = "lmr/scout/sweep"
_POLL_S = 0.05
_SWEEPS = itertools.count()


@dataclass(frozen=True)
class SweepReport:
    """What one full-catalog sweep found on this rank. `result` holds the per-module votes when
    the replay ran on every peer (also for SDC)."""

    outcome: SweepOutcome
    reason: str
    result: Optional[ReplayResult] = None

    @property
    def faulty_ranks(self) -> Tuple[int, ...]:
        checks = self.result.checks if self.result is not None else ()
        return tuple(sorted({r for c in checks for r in c.faulty}))


@dataclass(frozen=True)
class RecordedInvocation:
    """One forward call of the root model: detached clones of its inputs."""

    step: int
    args: tuple
    kwargs: dict
    autocast: List[List[str]]
    training: bool


class _Incomplete(Exception):
    """A peer did not answer in time or answered something unusable."""


_AUTOCAST = Field(types=(list,), items=array(text(max_length=64), max_length=2), max_length=2, required=False)
# The documents peers exchange through the store during one sweep, by key.
READY_SCHEMA = RecordSchema(what="sweep ready document",
                            fields={"step": integer(0), "recorded": nullable(integer(0))})
HEADER_SCHEMA = RecordSchema(what="sweep invocation header", max_bytes=64 * 1024 * 1024, fields={
    "ok": boolean(), "reason": text(nonempty=False, max_length=None, required=False),
    "step": integer(0, required=False), "structure": any_json(required=False),
    "layout": Field(types=(dict,), required=False), "autocast": _AUTOCAST, "training": boolean(required=False)})
SIGNATURES_SCHEMA = RecordSchema(what="sweep replay signatures", max_bytes=16 * 1024 * 1024, fields={
    "modules": array(array(nullable(text(nonempty=False, max_length=None)), max_length=4), max_length=None),
    "error": nullable(text(nonempty=False, max_length=None))})


class _NotRun(Exception):
    """The group has no evidence to replay."""


def _catalog_modules(catalog: ModuleCatalog) -> List[Tuple[str, str, nn.Module]]:
    """(check, path, module) for every catalog module, each path once: the classes in forward
    order, then the output rotation's remaining modules (a final norm, a table on the root), so
    the sweep signs every parameter of the model."""
    entries = [("embedding", *catalog.embedding)] if catalog.embedding else []
    entries += [("hidden", path, module) for path, module in catalog.hidden]
    entries += [("output", *catalog.output)] if catalog.output else []
    entries += [("output", path, module) for path, module in catalog.remaining]
    seen, out = set(), []
    for check, path, module in entries:
        if path not in seen:
            seen.add(path)
            out.append((check, path, module))
    return out


class FullCatalogSweep:
    """Records the root model's forward at SCOUT check steps and runs the full replay sweep.

    Build it with the peer group's `ReplayDetector` (same order on every rank: the construction
    count keys the session's store entries). `record(step)` before the forward of a check step;
    `run(step)` when recovery needs evidence (collective over the store, bounded)."""

    def __init__(self, detector: ReplayDetector, timeout_s: float) -> None:
        self.config = detector.config
        self.group_ranks = tuple(sorted(detector.group_ranks))
        self.rank = dist.get_rank() if dist.is_initialized() else self.group_ranks[0]
        self.timeout_s = timeout_s
        self.latest: Optional[RecordedInvocation] = None
        self._root = unwrap_model(detector.model)
        self._modules = _catalog_modules(detector.catalog)
        self._prefix = f"{STORE_PREFIX}/{next(_SWEEPS)}/group-{'-'.join(map(str, self.group_ranks))}"
        self._calls = itertools.count()
        self._handle: Optional[Any] = None
        self._replaying = False

    # -- recording ------------------------------------------------------------------------------

    def record(self, step: int) -> None:
        """Keep the inputs of the root model's next forward (call before the forward of `step`)."""
        self._remove_hook()
        self._handle = self._root.register_forward_pre_hook(functools.partial(self._record, step), with_kwargs=True,
                                                            prepend=True)

    def _record(self, step: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._replaying:
            return None
        self.latest = RecordedInvocation(step, clone_inputs(args, True), clone_inputs(kwargs, True),
                                         autocast_regions(), module.training)
        self._remove_hook()
        return None

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def close(self) -> None:
        self._remove_hook()
        self.latest = None

    # -- sweep ----------------------------------------------------------------------------------

    def run(self, step: int) -> SweepReport:
        """Replay the group's newest recording through the whole catalog on every peer and vote.

        `step` is this rank's optimizer step (peers must agree on it). Never raises for a peer's
        failure: those make the outcome INCOMPLETE."""
        if any(type(p).__name__ == "DTensor" for p in self._root.parameters()):
            return SweepReport(SweepOutcome.NOT_RUN, "the model has sharded (FSDP2/HSDP DTensor) parameters: a full "
                                                     "forward replay would all-gather them over the training process "
                                                     "group, which the failure may have made unusable")
        if len(self.group_ranks) < 2 or not dist.is_initialized():
            return SweepReport(SweepOutcome.NOT_RUN, f"rank {self.rank} has no equivalent peer to compare a replay "
                                                     f"against (peer group {list(self.group_ranks)})")
        deadline = time.monotonic() + self.timeout_s
        call = next(self._calls)
        try:
            store = _bounded_store(default_store(), self.timeout_s)
            return self._sweep(_Exchange(store, f"{self._prefix}/call-{call}", deadline, self.timeout_s), step)
        except _NotRun as exc:
            return SweepReport(SweepOutcome.NOT_RUN, str(exc))
        except _Incomplete as exc:
            return SweepReport(SweepOutcome.INCOMPLETE, str(exc))
        except Exception as exc:  # a broken store is missing evidence, never a clean sweep
            logger.exception("SCOUT full replay sweep failed on rank %d", self.rank)
            return SweepReport(SweepOutcome.INCOMPLETE, f"the sweep's c10d store exchange failed on rank "
                                                        f"{self.rank}: {type(exc).__name__}: {exc}")

    def _sweep(self, exchange: "_Exchange", step: int) -> SweepReport:
        recorded = self.latest
        exchange.publish(f"ready/{self.rank}", {"step": step, "recorded": recorded.step if recorded else None})
        ready = exchange.gather("ready", self.group_ranks, "join the sweep", READY_SCHEMA)
        steps = {r: doc.get("step") for r, doc in ready.items()}
        if len(set(steps.values())) > 1:
            raise _Incomplete(f"peers are at different optimizer steps {steps}; their replicas are not comparable")
        holders = {r: doc["recorded"] for r, doc in ready.items() if isinstance(doc.get("recorded"), int)}
        if not holders:
            raise _NotRun(f"no forward has been recorded at a SCOUT check step yet on ranks {list(self.group_ranks)}")
        newest = max(holders.values())
        source = min(r for r, s in holders.items() if s == newest)
        if source == self.rank:
            if recorded is None:
                raise _Incomplete(f"rank {self.rank} announced a recorded forward but no longer holds it")
            self._publish_invocation(exchange, recorded)
        header = exchange.gather("header", (source,), "publish its recorded invocation", HEADER_SCHEMA)[source]
        if not header.get("ok"):
            raise _NotRun(f"the recording of rank {source} cannot be replayed: {header.get('reason')}")
        local = self._replay(header, exchange.payload(), source)
        exchange.publish(f"signatures/{self.rank}", local)
        docs = exchange.gather("signatures", self.group_ranks, "answer with its replay signatures", SIGNATURES_SCHEMA)
        exchange.release(self.group_ranks, source)
        return self._decide(step, newest, source, docs)

    def _publish_invocation(self, exchange: "_Exchange", recorded: RecordedInvocation) -> None:
        try:
            encoded = encode_state({"args": recorded.args, "kwargs": recorded.kwargs})
            layout = Layout.for_tensors(encoded.tensors)
        except StateEncodingError as exc:
            exchange.publish(f"header/{self.rank}",
                             {"ok": False, "reason": f"its inputs cannot be shared without pickle: {exc}"})
            return
        buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        for view, tensor in zip(layout.views(buffer), encoded.tensors):
            view.copy_(tensor.reshape(view.shape))
        exchange.publish_bytes("payload", tensor_bytes(buffer))   # before the header that announces it
        exchange.publish(f"header/{self.rank}", {"ok": True, "step": recorded.step, "structure": encoded.structure,
                                    "layout": layout.to_json(), "autocast": recorded.autocast,
                                    "training": recorded.training})

    def _invocation(self, header: dict, payload: bytes, source: int) -> dict:
        """The published recording as `{"args": ..., "kwargs": ...}`; _Incomplete when malformed."""
        try:
            layout = Layout.from_json(header.get("layout"))
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
                torch.empty(0, dtype=torch.uint8)
            invocation = decode_state(header.get("structure"), list(layout.views(buffer)))
            if not isinstance(invocation, dict) or set(invocation) != {"args", "kwargs"}:
                raise StateSchemaError("the shared invocation must be {'args': ..., 'kwargs': ...}")
        except (StateSchemaError, TypeError) as exc:
            raise _Incomplete(f"the invocation published by rank {source} is malformed: {exc}") from exc
        return invocation

    def _replay(self, header: dict, payload: bytes, source: int) -> dict:
        """This peer's signatures of the replayed forward, or the error that stopped it."""
        doc: Dict[str, Any] = {"modules": [], "error": None}
        invocation = self._invocation(header, payload, source)
        outputs: Dict[str, List[str]] = {path: [] for _, path, _ in self._modules}

        def signer(path: str):
            def hook(module: nn.Module, args: tuple, output: Any) -> None:
                outputs[path].append(structure_signature(tensors_in(output)))
            return hook

        params = {path: structure_signature(list(module.parameters())) for _, path, module in self._modules}
        handles = [module.register_forward_hook(signer(path)) for _, path, module in self._modules]
        device = module_device(self._root)
        modes = [(m, m.training) for m in self._root.modules()]
        self._replaying = True
        try:
            with preserved_buffers(self._root):
                args, kwargs = to_device(tuple(invocation["args"]), device), to_device(invocation["kwargs"], device)
                self._root.train(bool(header.get("training", True)))
                with torch.no_grad(), SeededRng(self.config.seed + int(header["step"]), device), \
                        Autocast(header.get("autocast")):
                    self._root(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the peers learn it and the sweep is incomplete
            logger.warning("SCOUT full replay sweep: the replay raised on rank %d: %s", self.rank, exc)
            doc["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            self._replaying = False
            for handle in handles:
                handle.remove()
            for module, training in modes:
                module.training = training
        doc["modules"] = [[check, path, params[path], ",".join(outputs[path]) or None]
                          for check, path, _ in self._modules]
        return doc

    def _decide(self, step: int, recorded: int, source: int, docs: Dict[int, dict]) -> SweepReport:
        failed = {r: d["error"] for r, d in docs.items() if d.get("error")}
        if failed:
            raise _Incomplete("the replay raised on " + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())))
        malformed = [r for r, d in docs.items() if not isinstance(d.get("modules"), list)
                     or not all(isinstance(e, list) and len(e) == 4 for e in d["modules"])]
        if malformed:
            raise _Incomplete(f"ranks {malformed} published malformed replay signatures")
        plans = {r: [tuple(entry[:2]) for entry in d["modules"]] for r, d in docs.items()}
        reference = plans[self.rank]
        if any(plan != reference for plan in plans.values()):
            raise _Incomplete(f"peers disagree on the module catalog: {plans} (same model on every peer?)")
        checks = []
        for index, (check, path) in enumerate(reference):
            entries = {r: docs[r]["modules"][index] for r in self.group_ranks}
            checks.append(voted_outcome("parameters", path, self.group_ranks,
                                        {r: str(e[2]) for r, e in entries.items()}, "full replay sweep"))
            if any(e[3] is not None for e in entries.values()):
                checks.append(voted_outcome(check, path, self.group_ranks, {r: str(e[3]) for r, e in entries.items()},
                                            "full replay sweep"))
        result = ReplayResult(step=step, checks=tuple(checks))
        what = (f"{len(reference)} catalog modules replayed on ranks {list(self.group_ranks)} from rank {source}'s "
                f"recording of step {recorded}")
        report = SweepReport(SweepOutcome.CLEAN, f"{what}: every module agreed bitwise", result)
        if result.sdc:
            suspect = [f"{c.check} {c.module_path}" for c in checks if c.verdict != CLEAN]
            ranks = report.faulty_ranks
            blamed = f"ranks {list(ranks)}" if ranks else f"the peer pair {list(self.group_ranks)}"
            return SweepReport(SweepOutcome.SDC, f"{what}: SDC localized to {blamed} in {suspect}", result)
        if result.inconclusive:
            suspect = [f"{c.check} {c.module_path}" for c in checks if c.verdict != CLEAN]
            return SweepReport(SweepOutcome.INCOMPLETE, f"{what}: no strict majority on {suspect} (inconclusive)",
                               result)
        return report


def _bounded_store(store: Any, timeout_s: float) -> Any:
    """A private clone of the store whose blocking calls give up after `timeout_s`."""
    try:
        clone = store.clone()
        clone.set_timeout(timedelta(seconds=timeout_s))
        return clone
    except Exception as exc:  # noqa: BLE001 - custom stores may not clone; waits below are polled anyway
        logger.debug("store.clone() unavailable (%r); the sweep shares the default store", exc)
        return store


class _Exchange:
    """JSON documents and one byte payload under one call's key prefix, with polled, bounded waits
    (a key is only read after `check` found it, so no read blocks on a missing peer)."""

    def __init__(self, store: Any, prefix: str, deadline: float, timeout_s: float) -> None:
        self._store, self._prefix, self._deadline, self._timeout_s = store, prefix, deadline, timeout_s

    def publish(self, key: str, doc: dict) -> None:
        self._store.set(f"{self._prefix}/{key}", json.dumps(doc, separators=(",", ":"), allow_nan=False))

    def publish_bytes(self, key: str, data: bytes) -> None:
        self._store.set(f"{self._prefix}/{key}", data)

    def payload(self) -> bytes:
        return bytes(self._store.get(f"{self._prefix}/payload"))

    def release(self, ranks: Tuple[int, ...], source: int) -> None:
        """Called by each peer once it has read everything: the last one deletes the call's keys
        (the payload is a whole batch). A call some peer never finished keeps its keys, so a peer
        that skipped it can still read them at its next call."""
        if self._store.add(f"{self._prefix}/done", 1) < len(ranks):
            return
        keys = [f"{key}/{r}" for key in ("ready", "signatures") for r in ranks]
        for key in keys + [f"header/{source}", "payload", "done"]:
            try:
                self._store.delete_key(f"{self._prefix}/{key}")
            except Exception as exc:  # noqa: BLE001 - a store without delete keeps them; nothing depends on it
                logger.debug("SCOUT sweep: could not delete store key %s: %s", key, exc)
                return

    def gather(self, key: str, ranks: Tuple[int, ...], what: str, schema: RecordSchema) -> Dict[int, dict]:
        """The document `<key>/<rank>` of every rank in `ranks`, each satisfying `schema`."""
        names = {r: f"{self._prefix}/{key}/{r}" for r in ranks}
        docs: Dict[int, dict] = {}
        while True:
            for r in [r for r in ranks if r not in docs]:
                if self._store.check([names[r]]):
                    docs[r] = _parse(bytes(self._store.get(names[r])), schema, names[r], r)
            missing = [r for r in ranks if r not in docs]
            if not missing:
                return docs
            if time.monotonic() >= self._deadline:
                raise _Incomplete(f"ranks {missing} did not {what} within the sweep timeout "
                                  f"({self._timeout_s:g} s, full_sweep_timeout_s)")
            time.sleep(_POLL_S)


def _parse(raw: bytes, schema: RecordSchema, key: str, rank: int) -> dict:
    try:
        return parse_record(raw, schema, f"store key {key}")
    except RecordRejected as exc:
        raise _Incomplete(f"rank {rank} published a malformed sweep document: {exc}") from None
