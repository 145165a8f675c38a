"""`--rdzv-backend=lm_resiliency`: torch's dynamic rendezvous over the c10d store torchrun offers
(`store_type=file` on one host, `tcp` across hosts), plus what closed-loop recovery needs:

* node identity from the machine id (`derive_torchrun_node_id`); two agents with one identity
  in one run fail closed;
* the first `min_nodes` agents are active, later ones park as standbys (torch's redundancy list:
  the inner handler admits at most `min_nodes`) until an active node leaves;
* the worker policy digest is agreed run-wide: an agent with different policy bytes fails closed;
* before each worker generation the agents agree on the checkpoint step it must load (the newest
  step every node's workers recorded as captured) and write it, with the node's slot and the
  topology digest, to the owner-only restart context the workers read;
* with `lm_resiliency_worker_config`, workers start with the zero-import bootstrap (a
  `sitecustomize` shim on PYTHONPATH, the only way torchrun lets a plugin run code in a worker
  before the user module: the agent passes its environment to every worker it starts).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from datetime import timedelta
from typing import Optional

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (RendezvousGracefulExitError, RendezvousHandler, RendezvousInfo,
                                                  RendezvousParameters)

from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.context import CONTEXT_ENV, POLICY_DIGEST_ENV, POLICY_ENV, topology_digest
from lm_resiliency.torchrun._compat import membership, rendezvous_round
from lm_resiliency.torchrun.identity import derive_torchrun_node_id
from lm_resiliency.torchrun.policy import parse_policy, read_policy_bytes

logger = logging.getLogger(__name__)

BACKEND_NAME = "lm_resiliency"
CONTEXT_OPTION = "lm_resiliency_restart_context_path"
POLICY_OPTION = "lm_resiliency_worker_config"
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")
_NO_POLICY = "none"
_NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_STANDBY_POLL_S = 1.0
_STANDBY_MUTEX = "standby/joining"


class RendezvousRefused(RuntimeError):
    """This agent may not join the run (duplicate identity, policy mismatch, unsafe context)."""


class LMResiliencyRendezvousHandler(RendezvousHandler):
    """The `lm_resiliency` rendezvous handler; built by torchrun from `--rdzv-*` options."""

    def __init__(self, params: RendezvousParameters) -> None:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        context_path = params.get(CONTEXT_OPTION)
        if not context_path or not os.path.isabs(context_path):
            raise RendezvousRefused(f"--rdzv-conf {CONTEXT_OPTION}=<absolute path of context.json> is required "
                                    f"by --rdzv-backend={BACKEND_NAME}, got {context_path!r}")
        self.context_path = context_path
        self.context_dir = os.path.dirname(context_path)
        try:
            ctx.ensure_private_dir(self.context_dir)
        except ctx.ContextError as exc:
            raise RendezvousRefused(str(exc)) from None
        self.node_id = derive_torchrun_node_id()
        policy_path = params.get(POLICY_OPTION)
        self.policy_path: Optional[str] = None
        self.policy_digest: Optional[str] = None
        if policy_path:
            if not os.path.isabs(policy_path):
                raise RendezvousRefused(f"--rdzv-conf {POLICY_OPTION}={policy_path!r}: must be an absolute path")
            policy = parse_policy(policy_path, read_policy_bytes(policy_path))  # fails closed before joining
            self.policy_path, self.policy_digest = policy_path, policy.digest
        self.run_id = params.run_id
        # torch 2.13 keeps one agent-hosted TCPStore for every round while workers assume a fresh
        # store per restart ("no need to add prefix for each attempt"): a restarted gloo generation
        # then reads the dead generation's peer addresses and fails in init_process_group. Each
        # generation's rank 0 hosts a fresh store instead.
        os.environ[_NO_SHARED_STORE_ENV] = "1"
        self.join_timeout_s = float(params.get_as_int("join_timeout", 600) or 600)
        # The inner handler admits exactly min_nodes; later agents wait in torch's redundancy list.
        inner_params = RendezvousParameters(params.backend, params.endpoint, params.run_id, params.min_nodes,
                                            params.min_nodes, params.local_addr, **params.config)
        backend, store = create_backend(inner_params)
        self._inner = create_handler(store, backend, inner_params)
        self._store: Store = PrefixStore(f"lm_resiliency/{params.run_id}/", store)
        self._token = uuid.uuid4().hex
        self._slot: Optional[int] = None
        self._standby = False
        self.min_nodes = params.min_nodes
        # A node must stay missing twice as long as torch takes to declare it dead: an agent that
        # restarts its workers leaves the round and rejoins, slowly on a loaded host.
        self._standby_confirm_s = 2.0 * float(params.get_as_int("keep_alive_interval", 5) or 5) * float(
            params.get_as_int("keep_alive_max_attempt", 3) or 3)
        self._register()
        self._export_environment()
        logger.info("lm_resiliency rendezvous: node %s joins run %r (%d active nodes, up to %d with standbys)",
                    self.node_id[:12], self.run_id, params.min_nodes, params.max_nodes)

    def _register(self) -> None:
        holder = self._store.compare_set(f"node/{self.node_id}", "", self._token).decode()
        if holder != self._token:
            raise RendezvousRefused(
                f"node identity {self.node_id[:12]} (from the machine id) is already registered in run "
                f"{self.run_id!r} by another agent: two agents share one machine id. Give each node its own "
                "/etc/machine-id (or LM_RESILIENCY_MACHINE_ID_PATH file)")
        digest = self.policy_digest or _NO_POLICY
        agreed = self._store.compare_set("policy_digest", "", digest).decode()
        if agreed != digest:
            raise RendezvousRefused(
                f"worker policy digest {digest[:12]} differs from the one run {self.run_id!r} agreed at rendezvous "
                f"({agreed[:12]}); every node must pass identical {POLICY_OPTION} file contents")

    def _export_environment(self) -> None:
        os.environ[CONTEXT_ENV] = self.context_path
        if self.policy_path is None:
            return
        os.environ[POLICY_ENV] = self.policy_path
        os.environ[POLICY_DIGEST_ENV] = self.policy_digest or ""
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SHIM_DIR]
        os.environ["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, *paths])

    # ----------------------------------------------------------------- RendezvousHandler

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        if self._slot is None:
            self._wait_as_standby()
        info = self._inner.next_rendezvous()
        generation = rendezvous_round(self._inner)
        self._write_context(generation, info.rank, info.world_size)
        return info

    def _wait_as_standby(self) -> None:
        """An agent that arrives after the first generation formed parks here, outside torch's
        rendezvous, until an active node is gone (missing for twice the keep-alive expiry); then one
        standby at a time joins. In torch's redundancy list it would
        join any restart round and could take the place of a healthy node that was restarting."""
        members, formed, closed = membership(self._inner)
        if not formed:
            return
        logger.warning("lm_resiliency rendezvous: node %s parks as a standby of run %r", self.node_id[:12], self.run_id)
        short_since: Optional[float] = None
        while True:
            if closed:
                raise RendezvousGracefulExitError(f"run {self.run_id!r} ended while node {self.node_id[:12]} was a "
                                                  "standby")
            if members >= self.min_nodes:
                short_since = None
            elif short_since is None:
                short_since = time.monotonic()
            elif time.monotonic() - short_since >= self._standby_confirm_s:
                if self._store.compare_set(_STANDBY_MUTEX, "", self._token).decode() == self._token:
                    self._standby = True
                    return
            time.sleep(_STANDBY_POLL_S)
            members, formed, closed = membership(self._inner)

    def _write_context(self, generation: int, slot: int, nodes: int) -> None:
        local = ctx.node_step(self.context_dir, self.run_id)
        self._store.set(f"gen/{generation}/step/{slot}", json.dumps(-1 if local is None else local))
        keys = [f"gen/{generation}/step/{rank}" for rank in range(nodes)]
        try:
            self._store.wait(keys, timedelta(seconds=self.join_timeout_s))
        except Exception as exc:  # noqa: BLE001 - torch raises several store error types
            raise RendezvousRefused(f"generation {generation}: not every node published its checkpoint step "
                                    f"within {self.join_timeout_s:g}s ({exc})") from exc
        steps = [json.loads(self._store.get(key)) for key in keys]
        known = [step for step in steps if step >= 0]
        selected = min(known) if known else 0
        if not known:
            decision = "fresh"
        elif self._slot is None and local is None:
            decision = "replacement"
        else:
            decision = "same-node restart"
        self._slot = slot
        if self._standby:  # admitted: the next standby may join after the next loss
            self._store.set(_STANDBY_MUTEX, "")
            self._standby = False
        ctx.write_context(self.context_path, ctx.RestartContext(
            run_id=self.run_id, node_id=self.node_id, generation=generation, slot=slot, nodes=nodes,
            topology_digest=topology_digest(self.run_id, nodes), policy_digest=self.policy_digest,
            checkpoint_step=selected, checkpoint_source="gemini" if known else "none", decision=decision))
        logger.warning("lm_resiliency rendezvous: generation %d, node slot %d of %d: %s, checkpoint step %d",
                       generation, slot, nodes, decision, selected)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()
