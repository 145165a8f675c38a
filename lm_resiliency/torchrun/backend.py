"""`--rdzv-backend=lm_resiliency`: torch's dynamic rendezvous over the c10d store torchrun offers
(`store_type=file` on one host, `tcp` across hosts), plus what closed-loop recovery needs:

* a launch id the agents agree on, new for every launch of a run (launches.py): torch's own
  rendezvous and every key below live per launch, so a relaunch over a surviving file store
  never reads an earlier launch's rounds;
* node identity from the machine id (`derive_torchrun_node_id`); two live agents with one
  identity in one launch fail closed, a dead agent's identity is taken over;
* the first `min_nodes` agents are active; later ones park as standbys outside torch's rendezvous
  until an active node has been missing for twice the keep-alive expiry, then join one at a time
  (in torch's redundancy list a standby would join any restart round and could take the slot of
  a healthy node that was only restarting its workers);
* the worker policy digest is agreed run-wide: an agent with different policy bytes fails closed;
* before each worker generation the agents agree on the checkpoint step it must load (the newest
  step every node's workers recorded as captured; after a fault SCOUT localized, the newest
  RECOVERY_VERIFIED step) from the records bound to this run, launch, node and topology (stale
  ones are ignored, saying why), and write it, with the launch, generation, slot and topology,
  to the owner-only restart context the workers read; the workers check it against what the
  agent exports (launch, node, generation, a digest of the bytes);
* an agent cut off from the store (or unresponsive) for twice the keep-alive expiry is fenced
  (fencing.py): the others stop their workers and a standby takes its slot; it stops its workers
  and exits, never to rejoin the launch;
* an agent whose node slot SCOUT named faulty leaves the rendezvous and exits (`NodeRetired`),
  never to rejoin the run; the parked standby takes the free slot. A hang is recorded on the node
  of the one worker that reported it: its agent publishes the named slots in the store
  (`retire/<generation>/<slot>`, from its monitor loop, before that worker ends the generation),
  so the named agent finds them before it joins the next round;
* with `lm_resiliency_manager=1`, those decisions come from the successor generations a
  `TorchrunRecoveryCoordinator` publishes (coordinator.py) instead;
* with `lm_resiliency_worker_config`, workers start with the zero-import bootstrap (a
  `sitecustomize` shim on PYTHONPATH, the only way torchrun lets a plugin run code in a worker
  before the user module: the agent passes its environment to every worker it starts).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from datetime import timedelta
from typing import List, Optional, Tuple

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters

from lm_resiliency.config import RUN_ID_ENV
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import RecordRejected, encode_record
from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.binding import RoundBinding, StaleLog
from lm_resiliency.torchrun.context import CONTEXT_ENV, LAUNCH_ENV, NODE_ENV, POLICY_DIGEST_ENV, POLICY_ENV
from lm_resiliency.torchrun._compat import agent_local_world_size, leave_rendezvous, membership, rendezvous_round
from lm_resiliency.torchrun.fencing import Fence, PeerBeats, own_fence, within, write_fence
from lm_resiliency.torchrun.coordinator import (MANAGER_OPTION, TorchrunCoordinatorError, TorchrunSuccessorPlacement,
                                                check_lease, commit_placement, read_placement, successor_for)
from lm_resiliency.torchrun.identity import derive_torchrun_node_id
from lm_resiliency.torchrun.launches import LaunchError, LaunchMember, inner_run_id, node_key, run_store
from lm_resiliency.torchrun.policy import WorkerPolicy, parse_policy, read_policy_bytes
from lm_resiliency.torchrun.retirement import (FAULT_RECORD, NodeFault, NodeRetired, acknowledge_fault, fault_problem,
                                               read_fault)
from lm_resiliency.torchrun.selection import NODE_REPORT, NodeReport, Selection, SelectionRefused, select_step
from lm_resiliency.torchrun.worker_records import NodeSteps, node_steps

logger = logging.getLogger(__name__)

BACKEND_NAME = "lm_resiliency"
CONTEXT_OPTION = "lm_resiliency_restart_context_path"
POLICY_OPTION = "lm_resiliency_worker_config"
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")
_NO_POLICY = "none"
_NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_STANDBY_POLL_S = 1.0
_STANDBY_MUTEX = "standby/joining"
_PARKED = "standby/parked"  # how many standbys are parked now
_MAX_BEAT_INTERVAL_S = 1.0
_MAX_REASON = 8192  # a manager's reason is bounded by its own record; the context adds a note


class RendezvousRefused(ResiliencyError, RuntimeError):
    """This agent may not join the run (duplicate identity, policy mismatch, unsafe context)."""


class StandbyReleased(SystemExit):
    """The run ended while this agent was a parked standby: it was not needed and exits with
    status 0 (torch's launcher reports its own graceful rendezvous exit as a failure)."""


class LMResiliencyRendezvousHandler(RendezvousHandler):
    """The `lm_resiliency` rendezvous handler; built by torchrun from `--rdzv-*` options."""

    def __init__(self, params: RendezvousParameters) -> None:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        context_path = params.get(CONTEXT_OPTION)
        if not context_path or not os.path.isabs(context_path):
            raise RendezvousRefused(f"--rdzv-conf {CONTEXT_OPTION}=<absolute path of context.json> is required "
                                    f"by --rdzv-backend={BACKEND_NAME}, got {context_path!r}")
        self.context_path = context_path
        self.context_dir = os.path.dirname(context_path)
        try:
            ctx.ensure_context_dir(self.context_dir)
        except ctx.ContextError as exc:
            raise RendezvousRefused(str(exc)) from None
        self.node_id = derive_torchrun_node_id()
        self.run_id = params.run_id
        policy_path = params.get(POLICY_OPTION)
        self.policy_path: Optional[str] = None
        self.policy_digest: Optional[str] = None
        if policy_path:
            if not os.path.isabs(policy_path):
                raise RendezvousRefused(f"--rdzv-conf {POLICY_OPTION}={policy_path!r}: must be an absolute path")
            policy = parse_policy(policy_path, read_policy_bytes(policy_path))  # fails closed before joining
            self._check_run_identity(policy)
            self.policy_path, self.policy_digest = policy_path, policy.digest
        managed = params.get(MANAGER_OPTION, "0")
        if managed not in ("0", "1"):
            raise RendezvousRefused(f"--rdzv-conf {MANAGER_OPTION}={managed!r}: expected 0 or 1")
        self.managed = managed == "1"
        # torch 2.13 keeps one agent-hosted TCPStore for every round while workers assume a fresh
        # store per restart ("no need to add prefix for each attempt"): a restarted gloo generation
        # then reads the dead generation's peer addresses and fails in init_process_group. Each
        # generation's rank 0 hosts a fresh store instead.
        os.environ[_NO_SHARED_STORE_ENV] = "1"
        self.join_timeout_s = float(params.get_as_int("join_timeout", 600) or 600)
        keep_alive_s = float(params.get_as_int("keep_alive_interval", 5) or 5)
        expiry_s = keep_alive_s * float(params.get_as_int("keep_alive_max_attempt", 3) or 3)
        # A node must stay missing twice as long as torch takes to declare it dead before a standby
        # takes its place (an agent that restarts its workers leaves the round and rejoins, slowly
        # on a loaded host), and an agent silent that long is fenced: the same bound.
        self._fence_s = 2.0 * expiry_s
        self._endpoint = params.endpoint
        _, store = create_backend(RendezvousParameters(params.backend, params.endpoint, params.run_id,
                                                       params.min_nodes, params.min_nodes, params.local_addr,
                                                       **params.config))
        self._raw: Store = store
        self._run = run_store(store, params.run_id)
        self._check_not_retired()
        self._beat_interval_s = min(_MAX_BEAT_INTERVAL_S, keep_alive_s)
        self._member = LaunchMember(store, params.run_id, self.node_id, beat_interval_s=self._beat_interval_s,
                                    expiry_s=expiry_s)
        try:
            self.launch_id = self._member.join().launch_id
        except LaunchError as exc:
            raise RendezvousRefused(f"{exc}; remove the rendezvous file, or start the run with another --rdzv-id") \
                from None
        assert self._member.store is not None
        self._store: Store = self._member.store
        # torch's rendezvous state (round, participants, closed) starts afresh in every launch.
        inner_params = RendezvousParameters(params.backend, params.endpoint, inner_run_id(self.run_id, self.launch_id),
                                            params.min_nodes, params.min_nodes, params.local_addr, **params.config)
        self._inner = create_handler(store, C10dRendezvousBackend(store, inner_params.run_id), inner_params)
        self._token = uuid.uuid4().hex
        self._slot: Optional[int] = None
        self._generation: Optional[int] = None
        self._nodes = 0
        self._nproc: Optional[int] = None
        self._published: Optional[int] = None  # the generation whose local fault is in the store
        self._retired = False  # retired, fenced or a released standby: the run goes on without this agent
        self._standby = False
        self._peers: Optional[PeerBeats] = None  # the other nodes of the running generation
        self._fenced_peers: set = set()
        self._own_fence: Optional[Fence] = None
        self._next_fence_check = 0.0
        self._stale = StaleLog()
        self.min_nodes = params.min_nodes
        try:
            self._register()
        except BaseException:
            self._member.stop()
            raise
        self._export_environment()
        logger.info("lm_resiliency rendezvous: node %s joins launch %s of run %r (%d active nodes, up to %d with "
                    "standbys)", self.node_id[:12], self.launch_id[:12], self.run_id, params.min_nodes,
                    params.max_nodes)

    def _check_run_identity(self, policy: WorkerPolicy) -> None:
        """GEMINI's run id must be the run the agents agree on: the workers' records, the selected
        step and the fault records are all keyed by --rdzv-id."""
        checkpoint = policy.arguments.get("checkpoint")
        for where, value in ((f"[checkpoint] run_id in {policy.path}", getattr(checkpoint, "run_id", None)),
                             (f"{RUN_ID_ENV} in the agent's environment", os.environ.get(RUN_ID_ENV))):
            if value is not None and value != self.run_id:
                raise RendezvousRefused(
                    f"{where} is {value!r}, but --rdzv-id is {self.run_id!r}: under --rdzv-backend={BACKEND_NAME} "
                    "the rendezvous id names the run (GEMINI's files, the selected step and the agents' records are "
                    f"all keyed by it). Remove the run_id / {RUN_ID_ENV}, or start torchrun with --rdzv-id={value}")

    def _check_not_retired(self) -> None:
        key = f"retired/{self.node_id}"
        if self._run.check([key]):
            why = self._run.get(key).decode(errors="replace")
            raise RendezvousRefused(
                f"node {self.node_id[:12]} was retired from run {self.run_id!r} ({why}); it may not rejoin this run. "
                "Repair or replace the machine, then start a new run (--rdzv-id)")

    def _register(self) -> None:
        try:
            self._member.claim_node(self._token)
        except LaunchError as exc:
            raise RendezvousRefused(str(exc)) from None
        digest = self.policy_digest or _NO_POLICY
        agreed = self._store.compare_set("policy_digest", "", digest).decode()
        if agreed != digest:
            raise RendezvousRefused(
                f"worker policy digest {digest[:12]} differs from the one run {self.run_id!r} agreed at rendezvous "
                f"({agreed[:12]}); every node must pass identical {POLICY_OPTION} file contents")
        mode = "1" if self.managed else "0"
        agreed = self._store.compare_set("manager_mode", "", mode).decode()
        if agreed != mode:
            raise RendezvousRefused(f"--rdzv-conf {MANAGER_OPTION}={mode} differs from run {self.run_id!r} "
                                    f"({MANAGER_OPTION}={agreed}); every node must pass the same value")

    def _export_environment(self) -> None:
        os.environ.update({CONTEXT_ENV: self.context_path, LAUNCH_ENV: self.launch_id, NODE_ENV: self.node_id})
        if self.policy_path is None:
            return
        os.environ[POLICY_ENV] = self.policy_path
        os.environ[POLICY_DIGEST_ENV] = self.policy_digest or ""
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SHIM_DIR]
        os.environ["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, *paths])

    def _binding(self, generation: int, nodes: int) -> RoundBinding:
        return RoundBinding(run_id=self.run_id, launch_id=self.launch_id, node_id=self.node_id, generation=generation,
                            nodes=nodes, nproc_per_node=self._nproc)

    def _check_dir(self) -> None:
        try:
            ctx.check_context_dir(self.context_dir)
        except ctx.ContextError as exc:
            raise RendezvousRefused(str(exc)) from None

    # ----------------------------------------------------------------- RendezvousHandler

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        self._nproc = agent_local_world_size(self) or self._nproc
        self._peers = None
        self._refuse_if_fenced()
        if not self._member.current():
            raise RendezvousRefused(f"launch {self.launch_id[:12]} of run {self.run_id!r} was replaced by a newer "
                                    "launch of the same --rdzv-id while this agent was unresponsive; not starting "
                                    "another generation of it")
        fault = self._own_fault()
        if fault is None or self._slot not in fault.slots:
            fault = self._named_fault() or fault  # a hang: another node holds the record naming this slot
        successor = None
        if self.managed and self._generation is not None:
            successor = self._successor(self._generation + 1)
            if self._slot in successor.retire_slots:
                self._retire(f"the recovery manager retired slot {self._slot} in successor generation "
                             f"{successor.generation} ({successor.reason})")
        elif fault is not None and self._slot in fault.slots:
            self._retire(f"SCOUT found {fault.kind} at step {fault.step} on global ranks {list(fault.ranks)} in "
                         f"generation {fault.generation}")
        if self._slot is None:
            self._wait_as_standby()
        info = self._inner.next_rendezvous()
        generation = rendezvous_round(self._inner)
        if self.managed and successor is None and self._after_initial(generation):
            successor = self._successor(generation)  # a standby admitted to a managed run
        if successor is not None and successor.generation != generation:
            raise RendezvousRefused(f"the recovery manager published generation {successor.generation}, but the "
                                    f"rendezvous formed generation {generation}; not starting it")
        self._write_context(generation, info.rank, info.world_size, fault, successor)
        return info

    def _wait_as_standby(self) -> None:
        """An agent that arrives after the first generation formed parks here, outside torch's
        rendezvous, until an active node is gone (missing for the fence bound); then one standby per
        fence bound joins, until the run has its nodes again. The run ending releases it (exit 0)."""
        members, formed, closed = membership(self._inner)
        if not formed:
            return
        logger.warning("lm_resiliency rendezvous: node %s parks as a standby of run %r", self.node_id[:12], self.run_id)
        self._store.add(_PARKED, 1)
        try:
            self._park(members, closed)
        finally:
            within(lambda: self._store.add(_PARKED, -1), _STANDBY_POLL_S)

    def _park(self, members: int, closed: bool) -> None:
        short_since: Optional[float] = None
        holder, held_since = "", 0.0  # another standby that took the turn to join, and since when
        while True:
            if closed:
                self._retired = True  # never joined: closing again is not this agent's to do
                self._member.stop()
                logger.warning("lm_resiliency rendezvous: run %r ended while node %s was a parked standby; it was "
                               "not needed and exits (status 0)", self.run_id, self.node_id[:12])
                raise StandbyReleased(0)
            now = time.monotonic()
            if members >= self.min_nodes:
                short_since = None
            elif short_since is None:
                short_since = now
            elif now - short_since >= self._fence_s:
                held = self._store.compare_set(_STANDBY_MUTEX, "", self._token).decode()
                if held != holder:
                    holder, held_since = held, now
                if held != self._token and now - held_since >= self._fence_s:
                    # The standby that took the turn did not bring the run back to its nodes within
                    # the bound (two nodes lost, or it died on the way): the next one goes too.
                    held = self._store.compare_set(_STANDBY_MUTEX, held, self._token).decode()
                if held == self._token:
                    self._standby = True
                    return
            time.sleep(_STANDBY_POLL_S)
            members, _, closed = membership(self._inner)

    def _refuse_if_fenced(self) -> None:
        """Before every round: an agent that was cut off from the store for the fence bound, or that
        another agent fenced, leaves the run (fencing.py)."""
        silence = self._member.longest_silence_s()
        if self._own_fence is None:
            answered, fence = within(lambda: own_fence(self._store, self.node_id, self._token), self._fence_s)
            if answered and fence is None and silence < self._fence_s:
                return
            self._own_fence = fence
        self._retired = True
        self._member.stop()
        fence = self._own_fence
        if fence is not None:
            why = (f"node {fence.fenced_by[:12]} FENCED it in generation {fence.generation} after "
                   f"{fence.silent_s:.1f}s without its keep-alive (lost or cut off from the store)")
        elif silence >= self._fence_s:
            why = (f"it was cut off from the rendezvous store at {self._endpoint} for {silence:.1f}s (fence bound "
                   f"{self._fence_s:g}s: twice the keep-alive expiry), so the other nodes FENCED it")
        else:
            why = (f"the rendezvous store at {self._endpoint} does not answer, so the other nodes FENCE it once it "
                   f"is silent for {self._fence_s:g}s. If every node reports this, the store's host (the one serving "
                   "--rdzv-endpoint) is gone and the run cannot go on: relaunch the job, it resumes from what GEMINI "
                   "kept")
        raise RendezvousRefused(
            f"node {self.node_id[:12]} (slot {self._slot}) leaves run {self.run_id!r}: {why}. It stopped its workers "
            f"and may not rejoin launch {self.launch_id[:12]}, whose other nodes go on with a standby in its slot. "
            "Check this node's network; an agent started on it again parks as a standby")

    def _after_initial(self, generation: int) -> bool:
        if not self._store.check(["placement/initial"]):
            return False
        try:
            return read_placement(self._store.get("placement/initial").decode()).generation < generation
        except TorchrunCoordinatorError as exc:
            raise RendezvousRefused(f"store key placement/initial: {exc}") from None

    def _successor(self, generation: int) -> TorchrunSuccessorPlacement:
        try:
            return successor_for(self._store, self.run_id, generation, self.join_timeout_s)
        except TorchrunCoordinatorError as exc:
            raise RendezvousRefused(str(exc)) from None

    def _own_fault(self) -> Optional[NodeFault]:
        """The fault this node's workers recorded in the generation that just ended, if any."""
        if self._generation is None:
            return None
        self._check_dir()
        try:
            fault, ignored = read_fault(self.context_dir, self._binding(self._generation, self._nodes))
        except ctx.ContextError as exc:
            raise RendezvousRefused(str(exc)) from None
        self._stale.note(ignored)
        return fault

    def _named_fault(self) -> Optional[NodeFault]:
        """A fault another node recorded in the generation that just ended naming this node's slot
        (a hang: only the reporting worker's node has the record)."""
        if self._generation is None or self._slot is None:
            return None
        key = f"retire/{self._generation}/{self._slot}"
        if not self._store.check([key]):
            return None
        where = f"store key {key} of launch {self.launch_id[:12]}"
        try:
            fault = NodeFault.parse(self._store.get(key), where)
        except RecordRejected as exc:
            raise RendezvousRefused(str(exc)) from None
        why = fault_problem(fault, self._binding(self._generation, self._nodes))
        if why is not None:
            self._stale.note([f"{where}: {why}"])
            return None
        return fault

    def _publish_fault(self) -> None:
        """From the agent's monitor loop: put the fault this node's workers recorded in the running
        generation into the store for the slots it names, then tell the workers (a reporting worker
        waits for this before it ends the generation, so the store has it before any agent rejoins)."""
        generation = self._generation
        if generation is None or self._published == generation:
            return
        fault = self._own_fault()
        if fault is None:
            return
        for slot in fault.slots:
            self._store.set(f"retire/{generation}/{slot}", encode_record(fault.to_json(), FAULT_RECORD))
        acknowledge_fault(self.context_dir, self._binding(generation, self._nodes))
        self._published = generation
        logger.warning("lm_resiliency rendezvous: node %s published SCOUT's %s verdict of generation %d: node slots "
                       "%s retire", self.node_id[:12], fault.kind, generation, list(fault.slots))

    def _retire(self, why: str) -> None:
        self._run.set(f"retired/{self.node_id}", why)
        leave_rendezvous(self._inner, self.join_timeout_s)
        self._retired = True
        self._member.stop()
        logger.warning("lm_resiliency rendezvous: node %s (slot %s) RETIRED from run %r: %s. This agent left the "
                       "rendezvous and exits; it will not rejoin this run, a standby takes its slot",
                       self.node_id[:12], self._slot, self.run_id, why)
        raise NodeRetired()

    def _gather_reports(self, generation: int, slot: int, nodes: int,
                        fault: Optional[NodeFault]) -> Tuple[List[NodeReport], NodeSteps]:
        """Publish this node's report for `generation` and read every node's, in slot order; commit
        the round's placement (slots -> node ids)."""
        self._check_dir()
        local = node_steps(self.context_dir, self._binding(generation, nodes))
        self._stale.note(local.ignored)
        if local.inherited_from is not None:
            logger.warning("lm_resiliency rendezvous: node %s resumes from the worker records launch %s of run %r "
                           "left on this node (same nodes and --nproc-per-node): newest common step %d",
                           self.node_id[:12], local.inherited_from, self.run_id, local.latest)
        report = NodeReport(latest=local.latest, verified=local.verified, fault=fault, refused=local.refused,
                            node_id=self.node_id)
        self._store.set(f"gen/{generation}/node/{slot}", encode_record(report.to_json(generation, slot), NODE_REPORT))
        keys = [f"gen/{generation}/node/{rank}" for rank in range(nodes)]
        try:
            self._store.wait(keys, timedelta(seconds=self.join_timeout_s))
        except Exception as exc:  # noqa: BLE001 - torch raises several store error types
            raise RendezvousRefused(f"generation {generation}: not every node published its checkpoint step "
                                    f"within {self.join_timeout_s:g}s ({exc})") from exc
        try:
            reports = [NodeReport.parse(self._store.get(key), f"store key {key} of launch {self.launch_id[:12]}",
                                        generation, rank) for rank, key in enumerate(keys)]
        except RecordRejected as exc:
            raise RendezvousRefused(f"generation {generation}: {exc}") from None
        commit_placement(self._store, self.run_id, generation, tuple(r.node_id for r in reports))
        return reports, local

    def _select(self, generation: int, nodes: int, reports: list,
                successor: Optional[TorchrunSuccessorPlacement]) -> Selection:
        try:
            if successor is None:
                return select_step(reports)
            if successor.nodes != nodes:
                raise TorchrunCoordinatorError(f"the successor was planned for {successor.nodes} nodes, the "
                                               f"rendezvous formed {nodes}")
            remaining = check_lease(self._store, successor)
        except (SelectionRefused, TorchrunCoordinatorError) as exc:
            raise RendezvousRefused(f"generation {generation}: {exc}") from None
        logger.info("lm_resiliency rendezvous: successor lease of generation %d valid for %.1fs more",
                    generation, remaining)
        return Selection(step=successor.checkpoint_step, source=successor.checkpoint_source, trust=successor.trust,
                         reason=f"selected by the recovery manager: {successor.reason}",
                         retired_slots=successor.retire_slots, refused=())

    def _write_context(self, generation: int, slot: int, nodes: int, fault: Optional[NodeFault],
                       successor: Optional[TorchrunSuccessorPlacement]) -> None:
        reports, local = self._gather_reports(generation, slot, nodes, fault)
        selection = self._select(generation, nodes, reports, successor)
        if selection.source == "none":
            decision = "fresh"
        elif self._slot is None and reports[slot].latest < 0:
            decision = "replacement"
        else:
            decision = "same-node restart"
        self._slot, self._generation, self._nodes = slot, generation, nodes
        self._peers = PeerBeats(self._store, [(i, r.node_id) for i, r in enumerate(reports) if i != slot],
                                self._fence_s)
        self._fenced_peers = set()
        if self._standby:  # admitted: the next standby may join after the next loss
            self._store.compare_set(_STANDBY_MUTEX, self._token, "")
            self._standby = False
        reason = selection.reason[:_MAX_REASON]
        if local.ignored:
            reason += f"; {len(local.ignored)} stale record(s) on this node ignored (the agent's log names them)"
        context = ctx.RestartContext(
            run_id=self.run_id, launch_id=self.launch_id, node_id=self.node_id, generation=generation, slot=slot,
            nodes=nodes, nproc_per_node=self._nproc, topology_digest=ctx.topology_digest(self.run_id, nodes),
            policy_digest=self.policy_digest, checkpoint_step=selection.step, checkpoint_source=selection.source,
            decision=decision, trust=selection.trust, reason=reason, refused_steps=selection.refused)
        # The workers this agent starts next inherit its environment: what they check the file against.
        os.environ.update(ctx.context_environment(context, ctx.write_context(self.context_path, context)))
        logger.warning("lm_resiliency rendezvous: generation %d, node slot %d of %d: %s, checkpoint step %d (%s)",
                       generation, slot, nodes, decision, selection.step, reason)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """torch's agent calls this every monitor interval while its workers run; more than 0 makes
        it stop them and call next_rendezvous. A store call to a host cut off waits for the store's
        own timeout, so an answer that takes the fence bound counts as cut off."""
        if self._member.longest_silence_s() < self._fence_s:
            answered, waiting = within(self._watch, self._fence_s)
            if answered and waiting is not None:
                return waiting
        logger.error("lm_resiliency rendezvous: node %s (slot %s) cannot reach the rendezvous store at %s (no "
                     "keep-alive for %.1fs, fence bound %gs): stopping this node's workers", self.node_id[:12],
                     self._slot, self._endpoint, self._member.longest_silence_s(), self._fence_s)
        return 1

    def _watch(self) -> int:
        self._publish_fault()
        now = time.monotonic()
        if now >= self._next_fence_check:  # the counters move once per beat interval
            self._next_fence_check = now + self._beat_interval_s
            self._fence_silent_peers()
            self._found_own_fence()
        waiting = self._inner.num_nodes_waiting()
        return max(waiting, 1) if self._fenced_peers or self._own_fence is not None else waiting

    def _fence_silent_peers(self) -> None:
        """Fence the nodes of the running generation whose keep-alive stood still for the bound."""
        if self._peers is None or self._generation is None:
            return
        for slot, node_id, silent_s in self._peers.poll():
            if node_id in self._fenced_peers:
                continue
            token = self._store.get(node_key(node_id)).decode()
            write_fence(self._store, Fence(node_id=node_id, token=token, generation=self._generation, slot=slot,
                                           silent_s=silent_s, fenced_by=self.node_id))
            self._fenced_peers.add(node_id)
            logger.error("lm_resiliency rendezvous: node %s (slot %d of generation %d) has not reached the "
                         "rendezvous store for %.1fs (fence bound %gs): lost or cut off. FENCED: it may not rejoin "
                         "launch %s; stopping this node's workers, a standby takes its slot", node_id[:12], slot,
                         self._generation, silent_s, self._fence_s, self.launch_id[:12])

    def _found_own_fence(self) -> None:
        if self._own_fence is None:
            self._own_fence = own_fence(self._store, self.node_id, self._token)

    def get_run_id(self) -> str:
        return self.run_id  # torch's own rendezvous runs under the launch's inner id

    def shutdown(self) -> bool:
        self._member.stop()
        if self._retired:  # closing would end the run for the nodes that go on
            return True
        closed = self._inner.shutdown()
        self._release_standbys()
        return closed

    def _release_standbys(self) -> None:
        """Parked standbys learn that the run ended from torch's closed flag, and the store may go
        away with this agent: wait (two standby polls at most) until every parked one has seen it."""
        deadline = time.monotonic() + 2 * _STANDBY_POLL_S + 1.0
        while time.monotonic() < deadline:
            answered, parked = within(lambda: self._store.add(_PARKED, 0), _STANDBY_POLL_S)
            if not answered or not parked:
                return
            time.sleep(0.1)
