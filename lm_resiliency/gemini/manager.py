"""InMemoryCheckpointManager: capture -> peer replication -> node-local flush -> recovery.

Threads: the training thread only encodes the state and launches copies. A capture worker
finishes the copy and publishes the own slot, a replication worker exchanges it with the
peer, and a flush worker writes completed slots to node-local disk. Failures in any of
them are raised at the next `maybe_wait()` or `save()`.

Host slots live in node-owned shared memory by default (`InMemoryCkptConfig.host_memory`,
see shm.py): a worker that is SIGKILLed leaves its READY slots behind, and the next worker
process of the same rank, run and topology on that node adopts them at construction, so
`find_latest()` counts them as memory availability and `load()` never touches the disk.

Why one module of this size: the manager owns the three workers and their ordering (capture
before replication before flush); the pieces it delegates live in slots, replication, storage,
shm and selection.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from lm_resiliency import checksum, wire
from lm_resiliency.config import ConfigError, InMemoryCkptConfig, env_keep_shared_memory
from lm_resiliency.codec import Layout, StateSchemaError, check_structure, decode_state, encode_state
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.gemini.abandon import AbandonBoard, close_links
from lm_resiliency.gemini.device import launch_copy
from lm_resiliency.gemini.foreign import ForeignMemory, claim_memory, disk_identity, host_key, open_disks
from lm_resiliency.gemini import timeline
from lm_resiliency.gemini.identity import RunIdentity, resolve_identity, topology_fingerprint
from lm_resiliency.gemini.integrity import (CRC_KEY, IntegrityError, NonFiniteState, capture_checksums,
                                            checksum_problem, leaf_paths, nonfinite_indices)
from lm_resiliency.gemini.replication import (Pairing, PeerReplicator, agree_on_pairing, message_tag,
                                              resolve_jump)
from lm_resiliency.gemini.selection import (RecoveryPlan, availability_report, choose_plan, entries, has,
                                            missing_owners)
from lm_resiliency.gemini.shm import HostMemoryReport, SharedSlotArena, open_arena
from lm_resiliency.gemini.slots import Allocator, HostSlot, SlotPair, heap_allocator
from lm_resiliency.gemini.storage import NodeLocalStore, Shard, ShardKey, ShardRejected
from lm_resiliency.gemini.workers import BackgroundError, Worker

logger = logging.getLogger(__name__)

_KEEP_GENERATIONS = 2


class RecoveryUnavailable(ResiliencyError, RuntimeError):
    """A manager-selected step cannot be loaded on every rank (fails closed)."""


class InMemoryCheckpointManager:
    """Low-level GEMINI engine (unstable API; most users want `enable_resiliency`).

    Collective: construct, `find_latest()` and `load()` on every rank of the job together.
    `topology` is an adapter-provided JSON description of this rank's place in the
    parallel layout; it becomes part of the job-wide fingerprint that shards are bound to.
    `replicate=False` keeps two own slots only (HSDP replicas already hold the state).
    `allocator`, when given, replaces the host-slot allocator (heap semantics: no shared memory).
    """

    def __init__(self, config: Optional[InMemoryCkptConfig] = None, *,
                 topology: Optional[dict] = None, replicate: bool = True,
                 allocator: Optional[Allocator] = None,
                 install_signal_handlers: bool = True) -> None:
        self.config = config if config is not None else InMemoryCkptConfig()
        self._closed = False
        self._group: Optional[dist.ProcessGroup] = None
        self._group_aborted = False
        self._group_lock = threading.Lock()  # the training and replication threads both close the group
        self._abandoned: Optional[str] = None  # why this rank stopped replicating (its training failed)
        self._board: Optional[AbandonBoard] = None
        self._previous_handlers: Dict[int, Any] = {}
        self._workers: list = []
        self._sources: Dict[str, Any] = {}
        self._send_error: Optional[BaseException] = None
        self._layout_key: Optional[tuple] = None
        self._layout: Optional[Layout] = None
        # Steps whose shards pruning must keep (set by the session from the trust ledger).
        self.protected_steps: Callable[[], Iterable[int]] = tuple
        self._previous_excepthook = sys.excepthook
        self._arena: Optional[SharedSlotArena] = None
        # What this host keeps in other ranks' directories (foreign.py), claimed at the first
        # find_latest(); `_used_foreign`: the arenas the agreed plan reads from.
        self._foreign: List[ForeignMemory] = []
        self._foreign_stores: List[NodeLocalStore] = []
        self._foreign_open = False
        self._used_foreign: set = set()
        self._heap_bytes: Dict[str, int] = {}
        self._verified: set = set()
        self._keep_shared = False  # set when this process ends abnormally (signal, uncaught exception)
        self.recovery_sources: Dict[str, str] = {}
        # After find_latest(), on every rank: owner rank -> (rank providing its state, "memory" /
        # "shared-memory" / "disk"), and every step any rank reported (why nothing was chosen).
        self.job_recovery_sources: Dict[int, Tuple[int, str]] = {}
        self.steps_seen: List[int] = []
        self._loads = 0
        self._incoming_bytes: Optional[int] = None
        # Set by _setup: an enabled manager has a store; a replicating one (world size > 1) a pairing.
        self.pairing: Optional[Pairing] = None
        self.store: Optional[NodeLocalStore] = None
        self._plan: Optional[RecoveryPlan] = None
        if not self.config.enable:
            self._setup_disabled()
            return
        try:
            self._setup(topology, replicate, allocator, install_signal_handlers)
        except BaseException:
            self.close(keep_shared=True)  # a failed start never destroys a predecessor's slots
            raise
        atexit.register(_close_at_exit, weakref.ref(self))

    def _setup_disabled(self) -> None:
        """InMemoryCkptConfig(enable=False): no process group, slots, files or signal handlers;
        `save()` captures nothing and `find_latest()` finds nothing."""
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        logger.info("GEMINI: disabled (InMemoryCkptConfig.enable=False) on rank %d: nothing is "
                    "captured, written or recovered", self.rank)

    def _setup(self, topology: Optional[dict], replicate: bool, allocator: Optional[Allocator],
               install_signal_handlers: bool) -> None:
        timeout = float(self.config.timeout_s)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        if self.world_size > 1:
            # Dedicated gloo group: replication and agreement never queue behind training collectives.
            self._group = wire.new_group(None, timeout, "GEMINI's replication and recovery group")
        invalid: Optional[ConfigError] = None
        if replicate and self.world_size > 1:
            try:
                jump = resolve_jump(self.config.replication_jump, self.world_size)
                self.pairing = Pairing.for_rank(self.rank, self.world_size, jump)
            except ConfigError as exc:
                invalid = exc  # raised after the agreement, so the other ranks do not wait for us
        if self.world_size > 1:
            try:
                agree_on_pairing(self.pairing.jump if self.pairing else 0,
                                 self.config.replication_chunk_size if self.pairing else 0, self._group)
            except ConfigError:
                if invalid is None:
                    raise
        if invalid is not None:
            raise invalid
        # Resolved once: a later chdir must not move the node-local tier (or the shm namespace).
        self.config = dataclasses.replace(self.config, disk_folder=os.path.abspath(self.config.disk_folder))
        self.identity: RunIdentity = resolve_identity(self.config.run_id, self._group)
        self.run_id = self.identity.run_id
        # A new lineage per manager; `load()` forks it from the recovered (lineage, step).
        self._timeline = timeline.Timeline(timeline.draw_lineage(self._group))
        self._recovered: Optional[tuple] = None  # (lineage, ancestry) of the plan find_latest chose
        if self.pairing is not None:
            self._board = AbandonBoard.open(f"lm_resiliency/gemini/{self.run_id}/{self._timeline.lineage}/stopped/")
        descriptor = {"rank": self.rank, "world_size": self.world_size,
                      "jump": self.pairing.jump if self.pairing else 0, "topology": topology or {}}
        self.topology = topology_fingerprint(descriptor, self._group)
        self.store = NodeLocalStore(self.config.disk_folder, self.run_id, self.topology, self.rank,
                                    verify_integrity=self.config.verify_integrity, timeout_s=timeout)
        if self.rank == 0:
            logger.info("GEMINI: run %r keeps node-local state under %s (a relaunch must use the same folder)",
                        self.run_id, self.config.disk_folder)
            if self.config.verify_integrity and checksum.BACKEND != "isal":
                logger.info("GEMINI: integrity checksums: %s", checksum.backend_notice())
        allocate = allocator or heap_allocator(self.config.pin_memory)
        if allocator is None and self.config.host_memory == "shared":
            self._arena = self._open_arena()
        if self._arena is not None:
            allocate = self._arena.allocate
        else:
            allocate = self._counting(allocate)
        self._own = SlotPair("own", allocate, timeout, mirror=self._arena)
        self._peer = SlotPair("peer", allocate, timeout, mirror=self._arena) if self.pairing else None
        if self._arena is not None:
            self._adopt_predecessor_slots(self._arena)
        self._replicator = (PeerReplicator(self._group, self.rank, self.pairing,
                                           self.config.replication_chunk_size, timeout,
                                           on_failure=self._close_links)
                            if self.pairing else None)
        self._host = host_key()
        self._capture_done = threading.Event()
        self._capture_done.set()
        self._last_flushed_step = 0
        self._capture_worker = Worker("capture")
        self._replication_worker = Worker("replication")
        self._flush_worker = Worker("flush")
        self._workers = [self._capture_worker, self._replication_worker, self._flush_worker]
        if install_signal_handlers:
            self._install_signal_handlers()

    # ------------------------------------------------------------- host memory

    def _open_arena(self) -> Optional[SharedSlotArena]:
        arena, reason = open_arena(
            self.config.shared_memory_dir, self.run_id, self.topology, self.rank,
            series=self.config.disk_folder, verify_integrity=self.config.verify_integrity,
            pin_memory=self.config.pin_memory,
            peer_owner=self.pairing.recv_from if self.pairing else None,
            reap_other_runs_after_s=self.config.reap_other_runs_after_s)
        if arena is None:
            logger.warning("GEMINI: rank %d cannot use node-owned shared memory for host slots (%s); "
                           "falling back to process heap slots, which do not survive a worker crash "
                           "(recovery after a crash then uses peer replicas and node-local disk). Set "
                           "InMemoryCkptConfig.host_memory='heap' to silence this.", self.rank, reason)
        return arena

    def _counting(self, allocate: Allocator) -> Allocator:
        def counted(name: str, nbytes: int):
            buffer = allocate(name, nbytes)
            self._heap_bytes[name] = buffer.numel()
            logger.info("GEMINI: rank %d slot %s: %d bytes of heap memory; rank total %d bytes in %d "
                        "of 4 slots", self.rank, name, buffer.numel(), sum(self._heap_bytes.values()),
                        len(self._heap_bytes))
            return buffer
        return counted

    def _adopt_predecessor_slots(self, arena: SharedSlotArena) -> None:
        for found in arena.adopt():  # peer slots only where this rank holds a peer's replica
            pair = self._own if found.name.startswith("own") else self._peer_slots()
            pair.adopt(found.name, found.buffer, found.layout, found.structure, found.step,
                       found.owner_rank, found.extra, found.crc32, found.predecessor_pid)

    def _peer_slots(self) -> SlotPair:
        """The slots holding the partner's replica; only a replicating rank has them."""
        if self._peer is None:
            raise RuntimeError(f"GEMINI rank {self.rank} holds no peer replica: it does not replicate "
                               "(replicate=False or a world size of 1)")
        return self._peer

    def node_store(self) -> NodeLocalStore:
        """This rank's node-local store; only an enabled manager has one."""
        if self.store is None:
            raise RuntimeError("GEMINI has no node-local store: InMemoryCkptConfig.enable is False")
        return self.store

    def host_memory(self) -> HostMemoryReport:
        """Host-slot memory of this rank: mode ("shared" or "heap"), directory, bytes per slot
        (at most 4 slots: own and peer, current and previous)."""
        if self._arena is not None:
            return self._arena.report()
        if not self.config.enable:
            return HostMemoryReport("heap", None, {})
        return HostMemoryReport("heap", None, dict(self._heap_bytes))

    # ----------------------------------------------------------------- capture

    def save(self, state_dict: Any, step: int, *, check_finite: Optional[bool] = None) -> None:
        """Start capturing `state_dict` as `step`. Returns once copies are launched.

        `check_finite` (default: `InMemoryCkptConfig.check_finite`) refuses the capture when any
        floating tensor of `state_dict` holds NaN or Inf (raised at the next `maybe_wait()`). A
        caller that checked the tensors that matter itself passes False (the session checks
        parameters and optimizer state; metric state such as a best score of inf is legitimate)."""
        self._check_usable()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"save(step=...): step must be a non-negative int, got {step!r}")
        if not self.config.enable:
            return
        self.maybe_wait()
        encoded = encode_state(state_dict)
        layout = self._layout_for(encoded.tensors)
        target = self._own.begin_write(layout)
        pending = launch_copy(target.views(), encoded.tensors)
        self._capture_done.clear()
        check = self.config.check_finite if check_finite is None else bool(check_finite)
        self._capture_worker.submit(lambda: self._complete_capture(target, pending, step, encoded.structure,
                                                                   encoded.nonfinite if check else None))

    def _layout_for(self, tensors: list) -> Layout:
        """The previous capture's Layout object when shapes and dtypes are unchanged (the usual
        case), so slots can keep their typed views."""
        key = tuple((t.dtype, t.shape) for t in tensors)
        layout = self._layout
        if key != self._layout_key or layout is None:
            layout = Layout.for_tensors(tensors)
            self._layout_key, self._layout = key, layout
        return layout

    def maybe_wait(self) -> None:
        """Block until the prior capture is complete and its replication launched."""
        self._check_usable()
        if not self.config.enable:
            return
        if not self._capture_done.wait(self.config.timeout_s):
            raise TimeoutError(f"GEMINI capture did not complete within {self.config.timeout_s}s")
        self._raise_background_error()

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """GEMINI's dedicated gloo group (replication, recovery agreement and transfers); None
        single-process."""
        return self._group

    @property
    def latest_step(self) -> int:
        """Step of the newest complete own capture in memory, or -1."""
        if not self.config.enable:
            return -1
        ready = self._own.ready_slots()
        return ready[0].step if ready else -1

    def _complete_capture(self, target: HostSlot, pending, step: int, structure: Any,
                          nonfinite_values: Optional[Tuple[str, ...]]) -> None:
        """`nonfinite_values`: None when the finite check is off, else the paths of the
        non-tensor values that hold NaN or Inf (found while encoding)."""
        try:
            pending.finish()
            if nonfinite_values is not None:
                self._check_finite(target, step, structure, nonfinite_values)
            extra: Dict[str, Any] = {timeline.TIMELINE_KEY: self._timeline.record()}
            if self.config.verify_integrity:
                extra[CRC_KEY] = capture_checksums(target.payload())  # once, over the captured bytes
            self._own.publish(target, step, structure, self.rank, extra)
            if self._replicator is not None:
                self._own.acquire(target)
                self._replication_worker.submit(lambda: self._replicate(target))
            elif self._flush_due(step):
                self._submit_flush(target, None)
        except BaseException as exc:  # noqa: BLE001 - raised at the next maybe_wait()/save()
            # Kept before the capture is marked done, so the maybe_wait() it wakes sees it.
            if not isinstance(exc, NonFiniteState):  # that one was logged with its tensors
                logger.error("GEMINI capture of step %d failed: %s", step, exc)
            if self._capture_worker.error is None:
                self._capture_worker.error = exc
        finally:
            self._capture_done.set()

    def _check_finite(self, target: HostSlot, step: int, structure: Any, values: Tuple[str, ...]) -> None:
        """Refuse (never publish) a capture with NaN/Inf in a floating tensor, a float or a NumPy
        value; the previous capture stays the newest recoverable one."""
        bad = nonfinite_indices(target.views())
        if not bad and not values:
            return
        paths = leaf_paths(structure, bad) + list(values)
        shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
        message = (f"GEMINI capture of step {step} refused on rank {self.rank}: non-finite values (NaN or "
                   f"Inf) in {shown}. The step is not recoverable; the newest recoverable capture is "
                   f"step {self.latest_step}. Restart from it, or set InMemoryCkptConfig.check_finite="
                   "False if such values are intended (e.g. -inf mask buffers).")
        logger.error(message)
        raise NonFiniteState(message)

    def _replicate(self, source: HostSlot) -> None:
        try:
            self._exchange_replica(source)
        except BaseException as exc:
            self._abort_group_after_failure(source.step)
            if self._abandoned is not None:  # this rank's own decision, not a failure to report
                logger.warning("GEMINI: rank %d did not replicate step %d: %s", self.rank, source.step, exc)
                return
            pairing = self.pairing
            notice = (self._board.find(sorted({pairing.recv_from, pairing.send_to}))
                      if self._board is not None and pairing is not None else None)
            if notice is not None:
                raise RuntimeError(f"GEMINI replication of step {source.step} on rank {self.rank} failed because "
                                   f"{notice}; restart the job from the newest recoverable step. "
                                   f"The exchange reported: {exc}") from exc
            raise
        finally:
            self._own.release(source)

    def _abandon(self, reason: str) -> None:
        """This rank's training failed: it stops replicating now, so a partner waiting on it (or
        about to post an exchange with it) fails at once instead of after timeout_s, while this
        rank's own flush is not held up by an exchange with a partner that is itself stuck (e.g.
        in a training collective waiting for this rank). Its in-flight exchange ends and is not
        reported as an error; no later capture is replicated."""
        if self._abandoned is not None or getattr(self, "pairing", None) is None or self._closed:
            return
        self._abandoned = reason
        if self._board is not None:  # before the links close: the partners' errors read it
            self._board.mark(self.rank, self.latest_step, reason)
        self._close_links()

    def _close_links(self, why: str = "stopped replicating") -> None:
        """Close GEMINI's links on this rank, even while the replication worker waits on them."""
        with self._group_lock:
            if self._group is not None and self.pairing is not None:
                logger.debug("GEMINI: rank %d closes GEMINI's links: %s", self.rank, why)
                close_links(self._group, self.pairing.recv_from)

    def _abort_group_after_failure(self, step: int) -> None:
        """A failed exchange leaves this rank's pairs out of step, and the ranks chained to it
        (the one we send to, the one we hold) waiting on messages that will never come. Its
        links are closed (`_close_links`), so their waits fail at once instead of after
        timeout_s and every survivor reaches its own error (and exits) in seconds; the group is
        then destroyed and every reference dropped. The training thread raises the failure at
        the next maybe_wait(); nothing uses the group after it."""
        if self._group is None or self._group_aborted:
            return
        self._close_links(f"the replication of step {step} failed")
        with self._group_lock:
            self._group_aborted = True
            group, self._group = self._group, None
        if self._replicator is not None:
            self._replicator.group = None
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError) as exc:
            logger.debug("GEMINI: closing the group after the failed replication of step %d: %s", step, exc)
        del group

    def _exchange_replica(self, source: HostSlot) -> None:
        if self._abandoned is not None:
            raise RuntimeError(f"GEMINI replication of step {source.step} skipped: this rank stopped "
                               f"replicating ({self._abandoned})")
        if self._group_aborted:
            raise RuntimeError(f"GEMINI replication of step {source.step} skipped: GEMINI's group was "
                               "closed after an earlier replication failed; restart the job")
        if self._replicator is None:
            raise RuntimeError(f"GEMINI replication of step {source.step} skipped: rank {self.rank} has no "
                               "replication partner (replicate=False or a world size of 1)")
        peer = self._peer_slots()
        slot, header = self._replicator.exchange(source, peer.begin_write)
        if header["step"] != source.step:
            raise RuntimeError(f"GEMINI replication: rank {header['owner_rank']} sent step "
                               f"{header['step']} while this rank captured {source.step}")
        problem = self._bytes_problem(header["extra"], slot.payload(), header["step"])
        if problem is not None:
            raise IntegrityError(f"GEMINI replication: refused rank {header['owner_rank']}'s replica of "
                                 f"step {header['step']}: {problem}")
        peer.publish(slot, header["step"], header["structure"], header["owner_rank"], header["extra"])
        if self._flush_due(source.step):
            self._submit_flush(source, slot)

    # ------------------------------------------------------------------ flush

    def _flush_due(self, step: int) -> bool:
        every = self.config.disk_flush_interval
        return every > 0 and step // every > self._last_flushed_step // every

    def _submit_flush(self, own: HostSlot, peer: Optional[HostSlot]) -> None:
        self._last_flushed_step = own.step
        self._own.acquire(own)
        if peer is not None:
            self._peer_slots().acquire(peer)
        self._flush_worker.submit(lambda: self._flush(own, peer))

    def _flush(self, own: HostSlot, peer: Optional[HostSlot]) -> None:
        refused = []
        try:
            for kind, slot in (("own", own), ("peer", peer)):
                if slot is not None and self._write_slot(kind, slot) is not None:
                    refused.append(slot)
            self._prune()
        finally:
            self._own.release(own)
            if peer is not None:
                self._peer_slots().release(peer)
        if not refused:
            (logger.info if self.rank == 0 else logger.debug)(
                "GEMINI: rank %d flushed step %d%s to %s", self.rank, own.step,
                " and its peer replica" if peer is not None else "", self.node_store().directory)
        if refused:
            raise IntegrityError("GEMINI flush refused to write " + ", ".join(
                f"{slot.name} (rank {slot.owner_rank}, step {slot.step})" for slot in refused)
                + " (see the error above); nothing corrupt or abandoned was written")

    def _bytes_problem(self, extra: Optional[dict], payload: torch.Tensor, step: int) -> Optional[str]:
        """Why bytes with this `extra` must not be published, written or loaded now: another
        timeline, or (with verify_integrity) a mismatch against their capture checksum."""
        lineage = timeline.lineage_of(extra)
        if not self._timeline.contains(lineage, step):
            return (f"it belongs to timeline {lineage}, not to this run's current timeline "
                    f"{self._timeline.lineage} (abandoned at a recovery, or not recovered)")
        if self.config.verify_integrity:
            return checksum_problem(extra, payload)
        return None

    def _on_timeline(self, slot: HostSlot) -> bool:
        return self._timeline.contains(timeline.lineage_of(slot.extra), slot.step)

    def _write_slot(self, kind: str, slot: HostSlot) -> Optional[str]:
        """Write one slot, checked first (`_bytes_problem`); returns why it was not written, or
        None. A slot whose bytes no longer match their capture checksum is never offered again."""
        problem = self._bytes_problem(slot.extra, slot.payload(), slot.step)
        if problem is not None:
            logger.error("GEMINI: rank %d refuses to flush %s slot %s (rank %d, step %d): %s", self.rank, kind,
                         slot.name, slot.owner_rank, slot.step, problem)
            if self._on_timeline(slot):
                (self._own if kind == "own" else self._peer_slots()).invalidate(slot)
            return problem
        key = ShardKey(kind, slot.owner_rank, slot.step)
        self.node_store().write_shard(key, slot.written_layout(), slot.structure, slot.payload(), extra=slot.extra)
        return None

    def _prune(self) -> None:
        """Keep the newest generations and every step trust depends on (`protected_steps`).
        The status sidecar is not written here: it belongs to the trust ledger."""
        store = self.node_store()
        keys = store.list_shards()
        protected = set(self.protected_steps())
        keep = {k for k in keys if k.step in protected}
        for kind in ("own", "peer"):
            keep.update([k for k in keys if k.kind == kind][:_KEEP_GENERATIONS])
        store.prune(keep)

    def flush_now(self) -> int:
        """Synchronously write the newest complete own (and peer) slots; returns the step or -1.

        Used by the SIGTERM/SIGINT handler and `flush_for_restart()`. Waits (bounded) for the
        newest capture's replication so the held replica of the same step is written too."""
        if self._closed or not self.config.enable:
            return -1
        if not self._capture_done.wait(self.config.timeout_s):
            logger.error("GEMINI flush: the current capture did not complete in %ss; flushing the previous one",
                         self.config.timeout_s)
        elif not self._replication_worker.wait_idle(self.config.timeout_s):
            logger.error("GEMINI flush: replication did not finish in %ss; the replica may be older",
                         self.config.timeout_s)
        slot = None
        # Newest first, of the current timeline only; a refused (corrupt) slot falls back to the previous.
        for candidate in [c for c in self._own.ready_slots() if self._on_timeline(c)]:
            self._own.acquire(candidate)
            try:
                if self._write_slot("own", candidate) is None:
                    slot = candidate
                    break
            finally:
                self._own.release(candidate)
        if slot is None:
            return -1
        if self._peer is not None:
            peers = [p for p in self._peer.ready_slots() if p.step == slot.step and self._on_timeline(p)]
            if peers:
                self._peer.acquire(peers[0])
                try:
                    self._write_slot("peer", peers[0])
                finally:
                    self._peer.release(peers[0])
        self._prune()
        return slot.step

    # --------------------------------------------------------------- recovery

    def find_latest(self, step: Optional[int] = None, allowed_steps: Optional[Iterable[int]] = None) -> Optional[int]:
        """Collective: the newest step every rank can load (own memory, peer replica, node-local
        disk), or None. With `step`, only that exact step is considered; with `allowed_steps`
        (e.g. RECOVERY_VERIFIED steps), only those."""
        self._check_group()
        if not self.config.enable:
            return None
        self._drain()
        self._release_sources()
        self._plan = None
        try:
            allowed = None if allowed_steps is None else sorted(set(allowed_steps))
            self._agree_on_request(step, allowed)
            self._open_foreign()
            return self._select(step, allowed)
        except BaseException:
            self._release_sources()  # a slot left pinned here would block a later capture
            self._keep_shared = True  # a failed recovery never removes state the next attempt needs
            raise

    def _agree_on_request(self, step: Optional[int], allowed: Optional[List[int]]) -> None:
        """Every rank must ask for the same exact step and allowed steps: a rank that recovers
        another step than its peers would mix two steps in one job."""
        requests = wire.all_gather_json({"step": step, "allowed": allowed}, self._group)
        if any(request != requests[0] for request in requests):
            asked = "; ".join(f"rank {rank}: step {r['step'] if r['step'] is not None else 'newest'}"
                              + ("" if r["allowed"] is None else f" among {r['allowed']}")
                              for rank, r in enumerate(requests))
            raise RecoveryUnavailable(f"GEMINI recovery: the ranks asked for different steps ({asked}); every "
                                      "rank must request the same step, so nothing is loaded")

    def _open_foreign(self) -> None:
        """Once per manager, after every rank opened its own shared-memory directory (collective):
        claim what this host keeps in other ranks' directories (foreign.py)."""
        if self._foreign_open:
            return
        disk = disk_identity(self.config.disk_folder, self.run_id, self.topology)
        # Collective: every rank adopted its own slots before any claims another's.
        disks = wire.all_gather_json(disk, self._group) if self._group is not None else [disk]
        if self._arena is not None:
            self._foreign = claim_memory(
                self.config.shared_memory_dir, self.run_id, self.topology, series=self.config.disk_folder,
                rank=self.rank, world_size=self.world_size, jump=self.pairing.jump if self.pairing else 0,
                verify_integrity=self.config.verify_integrity, pin_memory=self.config.pin_memory,
                reap_other_runs_after_s=self.config.reap_other_runs_after_s, timeout_s=float(self.config.timeout_s))
        self._foreign_stores = open_disks(self.config.disk_folder, self.run_id, self.topology, rank=self.rank,
                                          world_size=self.world_size, verify_integrity=self.config.verify_integrity,
                                          timeout_s=float(self.config.timeout_s),
                                          sharing={r for r, d in enumerate(disks) if d == disk})
        self._foreign_open = True

    def _select(self, step: Optional[int], allowed_steps: Optional[Iterable[int]]) -> Optional[int]:
        report = self._local_availability()
        self.job_recovery_sources = {}
        while True:
            self._release_sources()  # a retry must not keep the previous attempt's slots pinned
            reports = wire.all_gather_json(report, self._group)
            self.steps_seen = sorted({step for r in reports for step, _ in entries(r["own"])}
                                     | {step for r in reports for held in r["held"].values()
                                        for step, _ in entries(held)})
            plan = choose_plan(reports, exact_step=step, allowed_steps=allowed_steps)
            if plan is None:
                if step is not None:
                    raise RecoveryUnavailable(_unavailable(step, reports))
                return None
            failed, seen = self._validate(plan)
            verdicts = wire.all_gather_json({"failed": failed, "seen": seen, "sends": self._send_sizes(plan),
                                             "sources": self.recovery_sources}, self._group)
            if not any(v["failed"] for v in verdicts):
                problem, recovered = _one_timeline(plan, verdicts, reports)
                if problem is None:
                    holder = plan.sources[self.rank]
                    self._incoming_bytes = (None if holder == self.rank
                                            else verdicts[holder]["sends"][str(self.rank)])
                    self._plan = RecoveryPlan(plan.step, plan.sources, recovered[0])
                    self._recovered = recovered
                    self.job_recovery_sources = {int(key.split(":")[1]): (source_rank, medium)
                                                 for source_rank, verdict in enumerate(verdicts)
                                                 for key, medium in verdict["sources"].items()}
                    logger.info("GEMINI: rank %d recovers step %d (timeline %s) from %s", self.rank, plan.step,
                                recovered[0], "itself" if holder == self.rank else f"rank {holder}")
                    return plan.step
                logger.warning("GEMINI: step %d is not eligible: %s", plan.step, problem)
                failed = [[owner, plan.step] for owner in [self.rank, *map(int, report["held"])]]
            for owner, bad_step in failed:
                for part in (report, report["memory"]):
                    if owner == self.rank:
                        part["own"] = [e for e in part["own"] if not has([e], bad_step, None)]
                    else:
                        held = part["held"].get(str(owner), [])
                        part["held"][str(owner)] = [e for e in held if not has([e], bad_step, None)]

    def _send_sizes(self, plan: RecoveryPlan) -> dict:
        """Bytes this rank will send to each rank whose state it provides: agreed before any
        transfer, so a receiver never allocates what a header merely claims."""
        return {str(owner): self._source_parts(f"held:{owner}")[0].total_bytes
                for holder, owner in plan.transfers()
                if holder == self.rank and f"held:{owner}" in self._sources}

    def load(self) -> Optional[Any]:
        """Collective: the state selected by `find_latest()` (tensors owned by the caller), or None
        when nothing was found, so the caller's fallback runs.

        Recovering (lineage L, step s) starts a new timeline whose parent is (L, s): every slot
        and node-local shard after s (abandoned) is dropped on every rank before any returns."""
        self._check_group()
        plan = self._plan
        if plan is None:
            return None
        try:
            return self._load(plan)
        except BaseException:
            self._keep_shared = True  # a failed recovery never removes state the next attempt needs
            raise

    def _load(self, plan: RecoveryPlan) -> Any:
        problem = None
        # A tag of its own per load: messages left by a failed earlier transfer never match.
        tag = message_tag(self._loads, recovery=True)
        self._loads += 1
        sender = threading.Thread(target=self._send_replicas, args=(plan, tag), daemon=True)
        try:
            sender.start()
            holder = plan.sources[self.rank]
            if holder == self.rank:
                layout, structure, tensors = self._own_source()
            else:
                layout, structure, tensors, problem = self._receive_replica(holder, plan, tag)
            sender.join(self.config.timeout_s)
            if sender.is_alive():
                raise TimeoutError("GEMINI recovery: sending replicas did not finish in time")
            if self._send_error is not None:
                error, self._send_error = self._send_error, None
                raise error
        finally:
            if sender.is_alive():
                sender.join(self.config.timeout_s)  # its source slots stay pinned until it is done
            self._release_sources()
            self._plan = None
        refused = [(r, p) for r, p in enumerate(wire.all_gather_json(problem, self._group)) if p]
        if refused:
            raise RecoveryUnavailable(f"GEMINI step {plan.step} was selected for recovery but received state was "
                                      "refused: " + "; ".join(f"rank {r}: {p}" for r, p in refused)
                                      + "; nothing is loaded. Restart to select again.")
        state = decode_state(structure, tensors)
        self._continue_timeline(plan.step)
        self._release_unused_foreign()
        return state

    def _release_unused_foreign(self) -> None:
        """After a recovery: other ranks' shared-memory directories it did not read from are
        removed (their state is older or held elsewhere too); those it read from stay mapped
        until close, in case this generation fails before its first capture."""
        kept = []
        for foreign in self._foreign:
            if id(foreign.arena) in self._used_foreign:
                kept.append(foreign)
                continue
            try:
                foreign.close(keep=False)
            except OSError as exc:
                logger.warning("GEMINI: removing rank %d's unused shared-memory slots failed: %s", foreign.rank, exc)
        self._foreign = kept

    def _continue_timeline(self, step: int) -> None:
        """Fork the timeline from the recovered state and drop what it abandons. Collective: no
        rank trains on (and captures into) the new timeline before every rank dropped its
        abandoned state."""
        if self._recovered is None:
            raise RuntimeError("GEMINI: the timeline continues from the plan find_latest() chose; call "
                               "find_latest() before load()")
        lineage, ancestry = self._recovered
        self._timeline = self._timeline.fork(lineage, ancestry, step, timeline.draw_lineage(self._group))
        error = None
        try:
            for pair, _ in self._memory_pairs():
                for slot in pair.ready_slots():
                    if not self._on_timeline(slot):
                        logger.info("GEMINI: rank %d drops abandoned %s slot %s of rank %d (step %d, timeline %s)",
                                    self.rank, pair.role, slot.name, slot.owner_rank, slot.step,
                                    timeline.lineage_of(slot.extra))
                        pair.invalidate(slot)
            for store in self._stores():
                for key in store.list_shards():
                    if key.step > step:
                        logger.info("GEMINI: rank %d removes abandoned shard %s in %s", self.rank, key.file_name,
                                    store.directory)
                        store.remove_shard(key)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        failed = [(r, e) for r, e in enumerate(wire.all_gather_json(error, self._group)) if e]
        if failed:
            raise RecoveryUnavailable("GEMINI recovery: dropping abandoned state failed on " + "; ".join(
                f"rank {r}: {e}" for r, e in failed) + "; do not continue training on this timeline")
        logger.info("GEMINI: rank %d continues on timeline %s from (%s, step %d)", self.rank,
                    self._timeline.lineage, lineage, step)

    def _memory_pairs(self) -> List[Tuple[SlotPair, Optional[SharedSlotArena]]]:
        """Every slot pair this rank can read, with the shared-memory arena behind it: its own and
        peer pairs, then those of other ranks' directories it claimed."""
        pairs: List[Tuple[SlotPair, Optional[SharedSlotArena]]] = [(self._own, self._arena)]
        if self._peer is not None:
            pairs.append((self._peer, self._arena))
        for foreign in self._foreign:
            pairs.extend((pair, foreign.arena) for pair in foreign.pairs)
        return pairs

    def _stores(self) -> List[NodeLocalStore]:
        """This rank's node-local store, then other ranks' directories on this host's disk."""
        return [self.node_store(), *self._foreign_stores]

    def _local_availability(self) -> dict:
        """By owner rank: memory slots as (step, lineage); node-local shards as steps (their lineage
        is only known once read); every timeline this rank knows, so abandoned state is recognized;
        this rank's host key."""
        timelines = {self._timeline.lineage: self._timeline.ancestry}
        own: set = set()
        held: Dict[int, set] = {}

        def offer(owner: int, entry: Any) -> None:
            (own if owner == self.rank else held.setdefault(owner, set())).add(entry)

        for pair, _ in self._memory_pairs():
            for slot in pair.ready_slots():
                parsed = timeline.parse(slot.extra)
                if parsed is not None:
                    timelines.setdefault(parsed[0], parsed[1])
                offer(slot.owner_rank, (slot.step, parsed[0] if parsed else None))
        memory = availability_report(own, held)  # slots of this process, adopted and claimed ones
        for store in self._stores():
            for key in store.list_shards():
                offer(key.owner_rank, key.step)
        report = availability_report(own, held, timelines)
        report["memory"] = memory
        report["host"] = self._host
        return report

    def _validate(self, plan: RecoveryPlan) -> tuple:
        """Load-check, for each owner rank this rank provides in `plan`, its copies in order (memory,
        then node-local disk) until one passes: identity, timeline and (with verify_integrity) the
        capture checksum. Returns (owner ranks of which no copy passed, as [owner, step]; [lineage,
        ancestry] of each source provided)."""
        failed, seen = [], []
        self.recovery_sources = {}
        self._used_foreign = set()
        for owner in sorted(o for o, provider in plan.sources.items() if provider == self.rank):
            name = f"own:{owner}" if owner == self.rank else f"held:{owner}"
            found = self._memory_copy(owner, plan)
            if found is not None:
                pair, slot = found
                pair.acquire(slot)
                self._sources[name] = (pair, slot)
                self.recovery_sources[name] = "memory" if slot.adopted_from is None else "shared-memory"
                seen.append(_timeline_of(slot.extra))
                continue
            shard = self._disk_copy(owner, plan)
            if shard is not None:
                self._sources[name] = shard
                self.recovery_sources[name] = "disk"
                seen.append(_timeline_of(shard.extra))
                continue
            failed.append([owner, plan.step])
        return failed, seen

    def _memory_copy(self, owner: int, plan: RecoveryPlan) -> Optional[Tuple[SlotPair, HostSlot]]:
        for pair, arena in self._memory_pairs():
            for slot in pair.ready_slots():
                if (slot.step != plan.step or slot.owner_rank != owner
                        or (plan.lineage is not None and timeline.lineage_of(slot.extra) != plan.lineage)):
                    continue
                if self._slot_intact(pair, slot, arena):  # corrupt: another copy or the disk may do
                    if arena is not None and arena is not self._arena:
                        self._used_foreign.add(id(arena))
                    return pair, slot
        return None

    def _disk_copy(self, owner: int, plan: RecoveryPlan) -> Optional[Shard]:
        for store in self._stores():
            key = ShardKey("own" if owner == store.rank else "peer", owner, plan.step)
            if key not in store.list_shards():
                continue
            try:
                shard = store.read_shard(key)
                self._check_shard(shard, plan)
                return shard
            except ShardRejected as exc:
                logger.warning("GEMINI: skipping step %d for rank %d: %s", plan.step, owner, exc)
        return None

    def _check_shard(self, shard: Shard, plan: RecoveryPlan) -> None:
        lineage = timeline.lineage_of(shard.extra)
        if plan.lineage is not None and lineage != plan.lineage:
            raise ShardRejected(f"shard {shard.key.file_name} of rank {shard.key.owner_rank} belongs to "
                                f"timeline {lineage}, not to the selected timeline {plan.lineage}")
        if self.config.verify_integrity:
            problem = checksum_problem(shard.extra, shard.payload)
            if problem is not None:
                raise ShardRejected(f"shard {shard.key.file_name} of rank {shard.key.owner_rank}: {problem}")

    def _slot_intact(self, pair: SlotPair, slot: HostSlot, arena: Optional[SharedSlotArena]) -> bool:
        """With verify_integrity, a memory slot is checked once against its capture checksum (and
        a predecessor's shared slot against its sidecar) before it may be used."""
        if not self.config.verify_integrity:
            return True
        token = (slot.name, slot.step, timeline.lineage_of(slot.extra), slot.written_buffer().data_ptr())
        if token in self._verified:
            return True
        if slot.adopted_from is not None and arena is not None and CRC_KEY in slot.extra:
            reason = arena.verify(slot.name)  # the sidecar, and the bytes against the capture checksum
        else:
            reason = checksum_problem(slot.extra, slot.payload())
        if reason is None:
            self._verified.add(token)
            return True
        logger.warning("GEMINI: rank %d refuses %s slot %s (rank %d, step %d): %s", self.rank, pair.role,
                       slot.name, slot.owner_rank, slot.step, reason)
        pair.invalidate(slot)
        return False

    def _source_parts(self, name: str) -> tuple:
        source = self._sources[name]
        if isinstance(source, Shard):
            return source.layout, source.structure, source.payload, source.extra
        _, slot = source
        return slot.layout, slot.structure, slot.payload(), slot.extra

    def _own_source(self) -> tuple:
        name = f"own:{self.rank}"
        layout, structure, payload, _ = self._source_parts(name)
        source = self._sources[name]
        if not isinstance(source, Shard):
            # A memory slot is reused by the next capture; the caller gets its own copy: for a
            # shared slot a copy-on-write private mapping of it (no bytes copied here), and the
            # slot's next capture goes to a fresh segment; for a heap slot a clone.
            pair, slot = source
            arena = next((a for p, a in self._memory_pairs() if p is pair), None)
            private = arena.private_view(slot.name, slot.buffer) if arena is not None else None
            if private is not None:
                pair.lend(slot)
                payload = private[: layout.total_bytes]
            else:
                payload = payload.clone()
        return layout, structure, layout.views(payload)

    def _send_replicas(self, plan: RecoveryPlan, tag: int) -> None:
        try:
            for holder, owner in plan.transfers():
                if holder != self.rank:
                    continue
                layout, structure, payload, extra = self._source_parts(f"held:{owner}")
                header = {"step": plan.step, "owner_rank": owner, "layout": layout.to_json(),
                          "structure": structure, "extra": extra}
                wire.send_json(header, owner, self._group, self.config.timeout_s, tag)
                wire.send_bytes(payload, owner, self._group, self.config.timeout_s, tag)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            self._send_error = exc

    def _receive_replica(self, holder: int, plan: RecoveryPlan, tag: int) -> tuple:
        """(layout, structure, tensors, problem): the problem, if any, is why the received bytes
        must not be loaded (another timeline, or a capture-checksum mismatch: corrupt in transit)."""
        header = wire.recv_json(holder, self._group, self.config.timeout_s, tag)
        layout = self._check_replica_header(header, holder, plan.step)
        payload = wire.recv_bytes(holder, self._group, self.config.timeout_s, tag,
                                  expected=layout.total_bytes)
        problem = None
        lineage = timeline.lineage_of(header["extra"])
        if lineage != plan.lineage:
            problem = f"rank {holder} sent timeline {lineage}, the plan is {plan.lineage}"
        elif self.config.verify_integrity:
            problem = checksum_problem(header["extra"], payload)
        if problem is None:
            try:  # refused on every rank alike below, instead of failing in decode_state on this one
                check_structure(header["structure"], layout)
            except StateSchemaError as exc:
                problem = f"rank {holder} sent a structure that does not match its layout: {exc}"
        return layout, header["structure"], layout.views(payload), problem

    def _check_replica_header(self, header: Any, holder: int, step: int) -> Layout:
        """The replica's layout when its header is what recovery agreed on (this step, this rank,
        the byte count rank `holder` reported); otherwise fail closed before allocating."""
        def refuse(why: str) -> RecoveryUnavailable:
            return RecoveryUnavailable(f"GEMINI recovery: rank {self.rank} refuses the replica header "
                                       f"from rank {holder}: {why}; nothing is loaded")

        if not isinstance(header, dict):
            raise refuse(f"expected a JSON object, got {type(header).__name__}")
        missing = sorted({"step", "owner_rank", "layout", "structure", "extra"} - set(header))
        if missing:
            raise refuse(f"missing {missing}")
        if header["extra"] is not None and not isinstance(header["extra"], dict):
            raise refuse(f"its extra record is a {type(header['extra']).__name__}, expected an object or null")
        identity = (header["step"], header["owner_rank"])
        if any(type(v) is not int for v in identity) or identity != (step, self.rank):
            raise refuse(f"it is step {header['step']!r} of rank {header['owner_rank']!r}, recovery "
                         f"agreed on step {step} of rank {self.rank}")
        try:
            layout = Layout.from_json(header["layout"])
        except ValueError as exc:
            raise refuse(f"invalid layout ({exc})") from exc
        if layout.total_bytes != self._incoming_bytes:
            raise refuse(f"its layout holds {layout.total_bytes} bytes, rank {holder} reported "
                         f"{self._incoming_bytes} when recovery was agreed")
        return layout

    def _release_sources(self) -> None:
        for source in self._sources.values():
            if not isinstance(source, Shard):
                pair, slot = source
                pair.release(slot)
        self._sources = {}

    # -------------------------------------------------------------- lifecycle

    def _drain(self) -> None:
        self.maybe_wait()
        for worker in self._workers:
            if not worker.wait_idle(self.config.timeout_s):
                raise TimeoutError(f"GEMINI {worker.name} worker did not finish within {self.config.timeout_s}s")
        self._raise_background_error()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("InMemoryCheckpointManager is closed")

    def _check_group(self) -> None:
        """Recovery is collective over GEMINI's group: refuse clearly once it was closed."""
        self._check_usable()
        if self._abandoned is not None:
            raise RuntimeError(f"InMemoryCheckpointManager: this rank stopped replicating ({self._abandoned}) "
                               "and closed GEMINI's group; restart the job to recover")
        if self._group_aborted:
            raise RuntimeError("InMemoryCheckpointManager: GEMINI's group was closed after a replication "
                               "exchange failed (the error was raised at maybe_wait()); restart the job "
                               "to recover")

    def _raise_background_error(self) -> None:
        for worker in self._workers:
            if worker.error is not None:
                error, worker.error = worker.error, None
                if isinstance(error, BackgroundError):  # already says what failed (NonFiniteState, IntegrityError)
                    raise error
                raise BackgroundError(f"GEMINI background {worker.name} failed: {error}") from error

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("GEMINI: not on the main thread; SIGTERM/SIGINT flush is not installed")
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught_exception

    def _on_uncaught_exception(self, exc_type, exc, tb) -> None:
        """A rank dying of an exception (often: its peer crashed mid-collective) still leaves its
        newest capture and the replica it holds on disk for the restart. Its shared-memory slots
        are kept for the restart too, whoever closes the manager later (atexit, a session)."""
        self._keep_shared = True
        self._abandon(f"uncaught {exc_type.__name__}")
        try:
            step = self.flush_now()
            logger.warning("GEMINI: rank %d is ending on an uncaught %s (below); %s", self.rank, exc_type.__name__,
                           _kept_for_restart(step, self.node_store().directory))
        except Exception:  # the original exception must still be reported
            logger.exception("GEMINI: flush on uncaught exception failed")
        self._previous_excepthook(exc_type, exc, tb)

    def _on_signal(self, signum: int, frame: Any) -> None:
        try:
            step = self.flush_now()
            logger.warning("GEMINI: rank %d received signal %d; %s", self.rank, signum,
                           _kept_for_restart(step, self.node_store().directory))
        except Exception:  # the previous handler must still run
            logger.exception("GEMINI: flush on signal %d failed", signum)
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        try:
            self.close(keep_shared=True)
        except Exception:  # the previous handler must still run
            logger.exception("GEMINI: close on signal %d failed", signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    @property
    def ending_abnormally(self) -> bool:
        """Whether this process is ending on a signal, an uncaught exception or a surface's
        `keep_shared_on_close()` (its shared-memory slots are then kept for the restart)."""
        return self._keep_shared

    def keep_shared_on_close(self) -> None:
        """This process is ending abnormally: `close()` keeps the shared-memory slots for a
        relaunch of the same run, as after a signal or an uncaught exception. It also stops
        replicating at once, so its partners' exchanges with it fail now (naming this rank)
        instead of after `timeout_s`, and its own flush does not wait on them."""
        self._keep_shared = True
        self._abandon("this launch ends abnormally")

    def close(self, keep_shared: Optional[bool] = None) -> None:
        """Finish background work (bounded), release the process group and the host slots.
        Idempotent.

        Shared-memory slots (`host_memory="shared"`) are removed when `keep_shared` is False:
        the clean end of the last run generation. They are kept for a restart of the same run
        when `keep_shared` is True, which a SIGTERM/SIGINT does implicitly. With the default
        None they are kept only if this process is ending abnormally (a signal or an uncaught
        exception reached the manager) or the environment variable
        LM_RESILIENCY_KEEP_SHARED_MEMORY=1 is set (how a supervisor that restarts workers
        keeps them across a planned stop). A SIGKILLed worker leaves them regardless; a run with
        another run id reaps them once older than `reap_other_runs_after_s`.

        A background failure nobody has collected yet (typically the final flush: disk full,
        read-only) is raised as BackgroundError once everything is released; the error names the
        file. Calling close() again does not raise it twice. Shared-memory slots are then kept,
        since they may hold the only copy of the newest state.
        """
        if self._closed:
            return
        if keep_shared is None:
            keep_shared = self._keep_shared or env_keep_shared_memory()
        self._closed = True
        for signum, previous in self._previous_handlers.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)
        self._previous_handlers = {}
        if sys.excepthook == self._on_uncaught_exception:
            sys.excepthook = self._previous_excepthook
        for worker in self._workers:
            if not worker.stop(self.config.timeout_s):
                logger.error("GEMINI %s worker did not stop within %ss", worker.name, self.config.timeout_s)
        # A failed last flush leaves the newest state only in shared memory: keep it for the relaunch.
        failed = any(worker.error is not None for worker in self._workers)
        try:
            self._raise_background_error()
        finally:
            self._release(bool(keep_shared) or failed)

    def _release(self, keep_shared: bool) -> None:
        self._release_sources()
        if self.store is not None:
            self.store.detach()
        for pair in (getattr(self, "_own", None), getattr(self, "_peer", None)):
            if pair is not None:
                pair.drop_buffers()
        if self._arena is not None:
            try:
                self._arena.close(keep=keep_shared)
            except OSError as exc:
                logger.warning("GEMINI: closing shared-memory slots failed: %s", exc)
        for foreign in self._foreign:
            try:
                foreign.close(keep=keep_shared)
            except OSError as exc:
                logger.warning("GEMINI: closing rank %d's shared-memory slots failed: %s", foreign.rank, exc)
        self._foreign = []
        if self._group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self._group)
            except (RuntimeError, ValueError) as exc:
                logger.debug("GEMINI: replication group already gone: %s", exc)
        self._group = None

    def __enter__(self) -> "InMemoryCheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
            return
        self._abandon(f"{exc_type.__name__} left the with-block")
        try:
            self.close(keep_shared=True)
        except Exception:  # the exception leaving the with-block is the one to see
            logger.exception("GEMINI: close() while handling %s failed", exc_type.__name__)


def _kept_for_restart(step: int, directory: str) -> str:
    if step < 0:
        return "no capture to keep for the restart yet"
    return f"its newest capture, step {step}, is written to {directory} for the restart"


def _timeline_of(extra: Optional[dict]) -> list:
    parsed = timeline.parse(extra)
    return [parsed[0], [list(a) for a in parsed[1]]] if parsed else [None, []]


def _one_timeline(plan: RecoveryPlan, verdicts: list, reports: list) -> tuple:
    """(problem, None) when the validated sources of `plan` are not one live timeline, else
    (None, (lineage, ancestry)) of the state to recover."""
    seen = [s for v in verdicts for s in v["seen"]]
    lineages = {s[0] for s in seen}
    if len(lineages) > 1:
        return (f"its sources lie on different timelines {sorted(map(str, lineages))}; two timelines are "
                "never mixed"), None
    lineage = lineages.pop() if lineages else plan.lineage
    known = [a for r in reports for a in r.get("timelines", {}).values()]
    if timeline.abandoned(lineage, plan.step, known):
        return f"timeline {lineage} was abandoned before step {plan.step} by a later recovery", None
    return None, (lineage, seen[0][1] if seen else [])


def _unavailable(step: int, reports: list) -> str:
    """Why an exact recovery of `step` is refused: the owner ranks of which no rank holds a
    usable copy, when that is the reason."""
    missing = missing_owners(reports, step)
    if missing:
        shown = ", ".join(map(str, missing))
        return (f"GEMINI step {step} was selected for recovery but is not loadable on every rank: no rank holds a "
                f"usable copy of rank{'s' if len(missing) > 1 else ''} {shown} at step {step} (in memory, shared "
                "memory or node-local disk: the hosts that held it are gone, or every copy was refused); refusing "
                "to load anything. Resume from a durable checkpoint instead")
    return (f"GEMINI step {step} was selected for recovery but is not loadable on every rank (its copies are "
            "corrupt, on different timelines or from another run/topology); refusing to load anything")


def _close_at_exit(ref: "weakref.ReferenceType") -> None:
    manager = ref()
    if manager is not None:
        try:
            manager.close()
        except Exception:  # nobody is left to raise it to
            logger.exception("GEMINI: close() at interpreter exit failed; the last flush may be missing")
