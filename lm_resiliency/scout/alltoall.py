"""AllToAll replay: capture the training step's Python-visible AllToAll calls, replay policy
matrices on their process groups with rank-tagged payloads, verify routing exactly, time them.

Per check:
1. `AllToAllRecorder` (installed for the check step's forward) wraps `all_to_all_single` and
   `all_to_all` in `torch.distributed` and records each call's group, row layout and input splits.
2. `AllToAllReplayer.run` exchanges every rank's records over a job-wide gloo group (one JSON
   all-gather), so every member of a group agrees on the capture replayed (one per group per
   check, rotating over the step's calls) and sees the observed split matrix.
3. For each group in sorted order, members run the policy's matrices on the captured group with
   payloads whose bytes encode (sender, receiver, row); each receiver compares what arrived
   with what must arrive, byte for byte.
4. A second all-gather shares bad routes and timings: the routing verdict names a receiver
   whose data from several senders is wrong (or a sender whose data is wrong at several
   receivers); a single bad route names the pair. Group latencies feed cross-PG localization.
Groups are replayed in one global order, so no two groups wait on each other.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lm_resiliency import wire
from lm_resiliency.scout.alltoall_policy import (
    ALL_TO_ALL_OPS,
    AllToAllCapture,
    AllToAllReplayPolicy,
    AllToAllTrafficMatrix,
)
from lm_resiliency.scout.peers import CLEAN, INCONCLUSIVE, PEER_GROUP, SDC
from lm_resiliency.scout.reports import CheckOutcome

logger = logging.getLogger(__name__)

ALL_TO_ALL_CHECK = "all_to_all"
_TAG_BYTES = 8


@dataclass
class _Call:
    group: Any
    ranks: Tuple[int, ...]
    op: str
    row_shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    splits: Tuple[int, ...]   # rows this rank sent to each group rank


def _group_ranks(group: Any) -> Tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _arguments(bound: inspect.BoundArguments) -> Dict[str, Any]:
    """Named arguments, those a wrapper's `**kwargs` collected included."""
    args = dict(bound.arguments)
    for parameter in bound.signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            args.update(args.pop(parameter.name, {}))
    return args


def _single_call(bound: inspect.BoundArguments) -> Optional[Tuple[Any, Tuple[int, ...], torch.Tensor]]:
    args = _arguments(bound)
    tensor, group = args.get("input"), args.get("group")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
        return None
    n = len(_group_ranks(group))
    splits = args.get("input_split_sizes")
    sizes = tuple(int(s) for s in splits) if splits else tuple([tensor.shape[0] // n] * n)
    return group, sizes, tensor


def _list_call(bound: inspect.BoundArguments) -> Optional[Tuple[Any, Tuple[int, ...], torch.Tensor]]:
    args = _arguments(bound)
    tensors, group = args.get("input_tensor_list"), args.get("group")
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        return None
    return group, tuple(int(t.shape[0]) for t in tensors), tensors[0]


class AllToAllRecorder:
    """Records the AllToAll calls made through `torch.distributed` while installed (one step).
    `remove()` restores the functions it replaced (idempotent); a function someone replaced
    after installation is left in place."""

    def __init__(self) -> None:
        self.calls: List[_Call] = []
        self._installed: List[Tuple[Any, str, Callable, Callable]] = []
        from torch.distributed import distributed_c10d as c10d

        for op, reader in (("all_to_all_single", _single_call), ("all_to_all", _list_call)):
            for namespace in (c10d, dist):
                original = namespace.__dict__.get(op)
                if callable(original):
                    wrapper = self._wrap(original, op, reader)
                    setattr(namespace, op, wrapper)
                    self._installed.append((namespace, op, original, wrapper))

    def _wrap(self, fn: Callable, op: str, reader: Callable) -> Callable:
        signature = inspect.signature(fn)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            try:
                seen = reader(signature.bind(*args, **kwargs))
            except (TypeError, ValueError, RuntimeError) as exc:
                logger.debug("SCOUT AllToAll capture skipped a %s call: %s", op, exc)
                seen = None
            if seen is not None:
                group, splits, tensor = seen
                self.calls.append(_Call(group, _group_ranks(group), op, tuple(tensor.shape[1:]), tensor.dtype,
                                        tensor.device, splits))
            return fn(*args, **kwargs)

        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        return recorded

    def remove(self) -> List[_Call]:
        """Uninstall; returns the calls recorded."""
        installed, self._installed = self._installed, []
        for namespace, op, original, wrapper in reversed(installed):
            if namespace.__dict__.get(op) is wrapper:
                setattr(namespace, op, original)
        return self.calls


def _tag_rows(src: int, dst: int, rows: int, row_bytes: int) -> torch.Tensor:
    """`rows` x `row_bytes` bytes naming (src, dst, row): an int64 tag leads each row, the
    rest is a tag-derived pattern (so a shifted, dropped or swapped row never matches)."""
    tags = (torch.tensor((src << 40) | (dst << 20), dtype=torch.int64) + torch.arange(rows, dtype=torch.int64))
    out = torch.empty((rows, row_bytes), dtype=torch.uint8)
    lead = min(_TAG_BYTES, row_bytes)
    out[:, :lead] = tags.unsqueeze(1).view(torch.uint8).view(rows, _TAG_BYTES)[:, :lead]
    if row_bytes > lead:
        columns = torch.arange(lead, row_bytes, dtype=torch.int64)
        out[:, lead:] = ((tags.unsqueeze(1) * 31 + columns) & 255).to(torch.uint8)
    return out


def _as_rows(data: torch.Tensor, capture: AllToAllCapture) -> torch.Tensor:
    """uint8 rows as a tensor of the capture's dtype and row shape (bytes unchanged)."""
    return data.view(capture.dtype).reshape((data.shape[0], *capture.row_shape))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(t.shape[0], -1).view(torch.uint8)


class AllToAllReplayer:
    """Runs the AllToAll replay of one check on every rank (collective over `exchange_group`,
    a job-wide gloo group, and over each captured group's members)."""

    def __init__(self, policy: AllToAllReplayPolicy, exchange_group: Any, timeout_s: float) -> None:
        self.policy = policy
        self.exchange_group = exchange_group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()

    def run(self, step: int, check_round: int, calls: Sequence[_Call]
            ) -> Tuple[List[CheckOutcome], Dict[Tuple[int, ...], float]]:
        """(routing outcomes of this rank's groups, latency of every replayed group)."""
        mine = [{"ranks": list(c.ranks), "op": c.op, "row_shape": list(c.row_shape), "dtype": str(c.dtype),
                 "splits": list(c.splits)} for c in calls]
        docs = wire.all_gather_json({"rank": self.rank, "calls": mine}, group=self.exchange_group,
                                    timeout_s=self.timeout_s)
        by_rank = {d["rank"]: d["calls"] for d in docs}
        plans = self._plans(by_rank, check_round)
        if not plans:  # no AllToAll anywhere this step: every rank sees it and stops here alike
            return [], {}
        results: List[dict] = []
        objects = {c.ranks: c for c in calls}
        for ranks in sorted(plans):
            if self.rank in ranks:
                capture, matrices, error = plans[ranks]
                results.append(self._replay(step, ranks, capture, matrices, objects.get(ranks), error))
        gathered = wire.all_gather_json({"rank": self.rank, "groups": results}, group=self.exchange_group,
                                        timeout_s=self.timeout_s)
        return self._decide(step, plans, gathered)

    def _plans(self, by_rank: Dict[int, list], check_round: int
               ) -> Dict[Tuple[int, ...], Tuple[Optional[AllToAllCapture], List[AllToAllTrafficMatrix], str]]:
        """Per captured group: the capture every member replays and its matrices, or why not.
        Computed from the gathered records, so identical on every rank."""
        per_group: Dict[Tuple[int, ...], Dict[int, list]] = {}
        for rank in sorted(by_rank):
            for call in by_rank[rank]:
                per_group.setdefault(tuple(call["ranks"]), {}).setdefault(rank, []).append(call)
        plans: Dict[Tuple[int, ...], Tuple[Optional[AllToAllCapture], List[AllToAllTrafficMatrix], str]] = {}
        for ranks, members in per_group.items():
            counts = {r: len(members.get(r, [])) for r in ranks}
            if len(set(counts.values())) != 1:
                plans[ranks] = (None, [], f"members recorded different numbers of calls on this group: {counts}")
                continue
            sequence = (check_round - 1) % counts[ranks[0]]
            chosen = [members[r][sequence] for r in ranks]
            layout = {(c["op"], tuple(c["row_shape"]), c["dtype"]) for c in chosen}
            if len(layout) != 1 or chosen[0]["op"] not in ALL_TO_ALL_OPS:
                plans[ranks] = (None, [], f"members recorded different layouts for call {sequence}: {sorted(layout)}")
                continue
            splits = [c["splits"] for c in chosen]
            observed = tuple(tuple(s) for s in splits) if all(len(s) == len(ranks) for s in splits) else None
            op, row_shape, name = layout.pop()
            dtype = getattr(torch, str(name).replace("torch.", ""), None)
            if not isinstance(dtype, torch.dtype):
                plans[ranks] = (None, [], f"call {sequence} has an unknown dtype {name!r}")
                continue
            capture = AllToAllCapture(group_ranks=ranks, op=op, row_shape=row_shape, dtype=dtype, sequence=sequence,
                                      observed_splits=observed)
            try:
                matrices = list(self.policy.generate(capture))
                bad = [m for m in matrices if not isinstance(m, AllToAllTrafficMatrix) or m.size != len(ranks)]
                if not matrices or bad:
                    raise ValueError(f"the policy must return {len(ranks)}x{len(ranks)} AllToAllTrafficMatrix "
                                     f"values, got {matrices!r}")
            except (ValueError, TypeError) as exc:
                plans[ranks] = (capture, [], f"{type(self.policy).__name__}.generate failed: {exc}")
                continue
            plans[ranks] = (capture, matrices, "")
        return plans

    def _replay(self, step: int, ranks: Tuple[int, ...], capture: Optional[AllToAllCapture],
                matrices: List[AllToAllTrafficMatrix], call: Optional[_Call], error: str) -> dict:
        doc: Dict[str, Any] = {"ranks": list(ranks), "matrices": [], "error": error}
        if error or capture is None or call is None:
            doc["error"] = error or f"rank {self.rank} recorded no call on this group"
            return doc
        me = capture.group_ranks.index(self.rank)
        row_bytes = capture.row_bytes
        for matrix in matrices:
            entry: Dict[str, Any] = {"name": matrix.name, "bad": [], "time": None, "error": None}
            try:
                send = torch.cat([_tag_rows(capture.group_ranks[me], capture.group_ranks[j], n, row_bytes)
                                  for j, n in enumerate(matrix.sent_by(me))])
                received = matrix.received_by(me)
                entry["time"], out = self._exchange(capture, call, matrix, me, send, received)
                offset = 0
                for src, n in enumerate(received):
                    expected = _tag_rows(capture.group_ranks[src], self.rank, n, row_bytes)
                    if not torch.equal(out[offset:offset + n], expected):
                        entry["bad"].append(capture.group_ranks[src])
                    offset += n
            except Exception as exc:  # noqa: BLE001 - a failed exchange is evidence for the verdict
                logger.warning("SCOUT AllToAll replay %s on group %s failed on rank %d at step %d: %s", matrix.name,
                               list(capture.group_ranks), self.rank, step, exc)
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            doc["matrices"].append(entry)
        doc["sequence"] = capture.sequence
        return doc

    def _exchange(self, capture: AllToAllCapture, call: _Call, matrix: AllToAllTrafficMatrix, me: int,
                  send: torch.Tensor, received: Tuple[int, ...]) -> Tuple[float, torch.Tensor]:
        device = call.device
        inp = _as_rows(send, capture).to(device)
        out = torch.empty((sum(received), *capture.row_shape), dtype=capture.dtype, device=device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        # Members start together, so a group's time is its own exchange, not a wait for a member
        # still busy in an earlier group (which would make every later group look slow).
        dist.barrier(group=call.group)
        begin = time.perf_counter()
        if capture.op == "all_to_all_single":
            dist.all_to_all_single(out, inp, output_split_sizes=list(received),
                                   input_split_sizes=list(matrix.sent_by(me)), group=call.group)
        else:
            outs = list(out.split(list(received)))
            dist.all_to_all(outs, list(inp.split(list(matrix.sent_by(me)))), group=call.group)
            out = torch.cat(outs) if outs else out
        sync()
        return time.perf_counter() - begin, _bytes_of(out)

    def _decide(self, step: int, plans: dict, gathered: List[dict]
                ) -> Tuple[List[CheckOutcome], Dict[Tuple[int, ...], float]]:
        reports: Dict[Tuple[int, ...], Dict[int, dict]] = {}
        for doc in gathered:
            for group in doc["groups"]:
                reports.setdefault(tuple(group["ranks"]), {})[doc["rank"]] = group
        outcomes: List[CheckOutcome] = []
        latencies: Dict[Tuple[int, ...], float] = {}
        for ranks in sorted(plans):
            members = reports.get(ranks, {})
            times = [sum(m["time"] for m in r["matrices"] if m["time"] is not None) for r in members.values()]
            complete = len(members) == len(ranks) and all(
                m["time"] is not None for r in members.values() for m in r["matrices"])
            if complete and times and not any(r["error"] for r in members.values()):
                latencies[ranks] = max(times)
            if self.rank in ranks:
                outcomes.append(self._outcome(step, ranks, plans[ranks], members))
        return outcomes, latencies

    def _outcome(self, step: int, ranks: Tuple[int, ...], plan: tuple, members: Dict[int, dict]) -> CheckOutcome:
        capture, matrices, error = plan
        path = f"{capture.op if capture else 'all_to_all'}#{capture.sequence if capture else '?'}" \
               f"(group={list(ranks)})"
        if error:
            return CheckOutcome(check=ALL_TO_ALL_CHECK, module_path=path, group_ranks=ranks,
                                signatures={r: "error" for r in ranks}, verdict="error", detail=error)
        bad = sorted({(src, dst) for dst, r in members.items() for m in r["matrices"] for src in m["bad"]})
        failed = {dst: m["error"] for dst, r in members.items() for m in r["matrices"] if m["error"]}
        signatures = {r: "ok" for r in ranks}
        for src, dst in bad:
            signatures[dst] = signatures[dst].replace("ok", "bad:from") + f"{src},"
        for dst in failed:
            signatures[dst] = "failed"
        timings = {r: sum(m["time"] or 0.0 for m in members[r]["matrices"]) for r in members}
        verdict, detail = CLEAN, ""
        faulty: Tuple[int, ...] = ()
        if bad:
            verdict, faulty = _localize(bad)
            detail = f"routes delivered wrong bytes (sender, receiver): {bad}"
            logger.error("SCOUT AllToAll replay at step %d on group %s: %s -> %s %s", step, list(ranks), detail,
                         verdict, list(faulty))
        elif failed:
            verdict, detail = INCONCLUSIVE, f"the exchange failed on ranks {sorted(failed)}: {failed}"
        return CheckOutcome(check=ALL_TO_ALL_CHECK, module_path=path, group_ranks=ranks, signatures=signatures,
                            verdict=verdict, faulty=faulty, timings_s=timings,
                            detail=detail or ", ".join(m.name for m in matrices))


def _localize(bad: List[Tuple[int, int]]) -> Tuple[str, Tuple[int, ...]]:
    """Which end of the bad routes is faulty: one receiver wrong from several senders (or from
    itself), or one sender wrong at several receivers. A single route between two ranks names
    the pair ("peer_group"), anything else is inconclusive."""
    receivers = {dst for _, dst in bad}
    senders = {src for src, _ in bad}
    if len(receivers) == 1 and (len(senders) > 1 or senders == receivers):
        return SDC, tuple(receivers)
    if len(senders) == 1 and len(receivers) > 1:
        return SDC, tuple(senders)
    if len(bad) == 1:
        return PEER_GROUP, ()
    return INCONCLUSIVE, ()
