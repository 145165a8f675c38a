"""`CertificationLedger`: the certification rules (`trust.rules`) made job-wide and persistent.

It gathers every rank's view over the checkpoint group (JSON, no pickle), applies the pure rules,
runs the durable side of a boundary on rank 0 (`trust.publish`) and persists the state through a
`StatusStore` (GEMINI's `NodeLocalStore` satisfies it).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch.distributed as dist

from lm_resiliency._values import ConfigError, is_int
from lm_resiliency.files import json_copy
from lm_resiliency.trust import rules
from lm_resiliency.trust.decision import BoundaryDecision
from lm_resiliency.trust.durable import DurableCheckpointConfig
from lm_resiliency.trust.errors import CertificationError, DurableCheckpointError
from lm_resiliency.trust.manifests import ManifestStore
from lm_resiliency.trust.publish import run_plan
from lm_resiliency.wire import all_gather_json

logger = logging.getLogger(__name__)


class StatusStore(Protocol):
    """Where a rank's trust record persists: a JSON sidecar next to its checkpoint shards.
    Certification writes its record under the ``"trust"`` key and keeps the other keys."""

    def read_status(self) -> Optional[Dict[str, Any]]: ...
    def write_status(self, status: Dict[str, Any]) -> None: ...


class CertificationLedger:
    """The checkpoint-trust state machine of one rank (rules: the `lm_resiliency.trust` docstring).

    catalog_size: K, the number of replay-shape recipes in one cycle (1 = dense).
    dynamic: a dynamic catalog (MoE recipes): the candidate protocol even at K = 1.
    status_store: a `StatusStore` (GEMINI's `NodeLocalStore`); trust lives under its ``"trust"`` key.
    group: the gloo process group of the checkpoint ranks for job-wide agreement; None only for a
        single-process job. With a group, construction, `boundary` and `load_verified_durable` are
        collective: call them on every rank of the group in the same order.
    durable: optional `DurableCheckpointConfig`.
    """

    def __init__(self, catalog_size: int, status_store: StatusStore, *, group: Any = None,
                 durable: Optional[DurableCheckpointConfig] = None, dynamic: bool = False) -> None:
        if not is_int(catalog_size) or catalog_size < 1:
            raise ConfigError(f"CertificationLedger.catalog_size: must be a positive integer, got {catalog_size!r}")
        for method in ("write_status", "read_status"):
            if not callable(getattr(status_store, method, None)):
                raise ConfigError(f"CertificationLedger.status_store: must provide callable write_status and "
                                  f"read_status (GEMINI's NodeLocalStore); {type(status_store).__name__} "
                                  f"lacks {method}")
        if durable is not None and not isinstance(durable, DurableCheckpointConfig):
            raise ConfigError(f"CertificationLedger.durable: must be a DurableCheckpointConfig or None, got "
                              f"{type(durable).__name__}")
        initialized = dist.is_available() and dist.is_initialized()
        if group is None and initialized and dist.get_world_size() > 1:
            raise ConfigError(f"CertificationLedger.group: None means a single-process job, but torch.distributed "
                              f"runs {dist.get_world_size()} ranks; pass the checkpoint process group "
                              "(for example dist.group.WORLD) so trust decisions are agreed job-wide")
        if group is not None and not initialized:
            raise ConfigError("CertificationLedger.group: a process group was given but torch.distributed is "
                              "not initialized")
        self._store = status_store
        self._group = group
        self._durable = durable
        self._manifests = ManifestStore(durable.manifest_dir, durable.environment_id) if durable else None
        self._state = rules.TrustState(catalog_size, dynamic=bool(dynamic))
        self._open()

    def _open(self) -> None:
        """Load the persisted trust; with a group, reconcile it across ranks (collective)."""
        error: Optional[BaseException] = None
        changed = held = False
        try:
            status = self._store.read_status()
            if status is not None and "trust" in status:
                held = True
                self._state, changed = rules.loaded(self._state, status["trust"])
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks below, then raised
            error = exc
        if self._group is None:
            if error is not None:
                raise error
        else:
            views = self._gather({"error": None if error is None else f"{type(error).__name__}: {error}",
                                  "catalog_size": self.catalog_size, "trust": self.trust(), "held": held})
            failed = [(r, v["error"]) for r, v in enumerate(views) if v["error"]]
            if failed:
                raise CertificationError("CertificationLedger: could not load certification trust: "
                                         + "; ".join(f"rank {r}: {e}" for r, e in failed)) from error
            sizes = sorted({v["catalog_size"] for v in views})
            if len(sizes) > 1:
                raise CertificationError(f"CertificationLedger: ranks disagree on catalog_size ({sizes}); every "
                                         "rank of the group must use the same replay-shape catalog")
            before = self.trust()
            # A rank with no trust record at all (its host and disk were lost: a standby's rank, or
            # a rank that moved to another host) knows nothing and vetoes nothing; it takes what
            # every rank that holds a record agrees on (the certification was job-wide).
            held_trusts = [v["trust"] for v in views if v["held"]]
            if held_trusts:
                self._state = rules.reconcile(self._state, held_trusts)
            changed |= self.trust() != before
        if changed:
            self._persist()

    # ------------------------------------------------------------ properties

    @property
    def catalog_size(self) -> int:
        return self._state.catalog_size

    @property
    def candidate_step(self) -> Optional[int]:
        """The current CANDIDATE step (dynamic catalogs), or None."""
        return self._state.candidate_step

    @property
    def candidate_checkpoint_id(self) -> Optional[str]:
        return self._state.candidate[1] if self._state.candidate else None

    @property
    def recovery_verified_step(self) -> Optional[int]:
        """The newest RECOVERY_VERIFIED step, or None."""
        return self._state.verified_step

    @property
    def recovery_verified_checkpoint_id(self) -> Optional[str]:
        """The durable checkpoint id of the newest RECOVERY_VERIFIED step, if it has one."""
        return self._state.history[0][1] if self._state.history else None

    @property
    def sdc_detected_step(self) -> Optional[int]:
        """The newest boundary step at which SDC was detected, or None."""
        return self._state.sdc_step

    @property
    def requires_verified_recovery(self) -> bool:
        """SDC was detected and training state has not been restored from verified state since:
        a restart must use RECOVERY_VERIFIED, and no boundary captures or certifies until then."""
        return self._state.sdc_pending

    def verified_steps(self) -> List[int]:
        """RECOVERY_VERIFIED steps, newest first (bounded history; exact recovery still requires
        the shards of the selected step to be present)."""
        return self._state.verified_steps()

    def trust(self) -> Dict[str, Any]:
        """The persisted trust record (JSON)."""
        return self._state.to_doc()

    # ------------------------------------------------------------ boundary

    def boundary(self, step: int, local_verdict: str, cycle_complete: bool,
                 finite: bool = True) -> BoundaryDecision:
        """Agree on one SCOUT boundary job-wide and apply the certification rules. Collective.

        Call it after SCOUT's check at `step` and before GEMINI's capture of `step`; capture only if
        the returned decision says ``capture``. `local_verdict` is this rank's outcome for its
        comparison group (`verdict_of`); `cycle_complete` is True at the last recipe of a cycle
        (always True for a dense catalog). `finite` is False when this rank's parameters or
        optimizer state hold NaN or Inf: then nothing is captured or certified anywhere.

        Steps: gather every rank's view, agree on it (`rules.agreed`), decide (`rules.plan_boundary`),
        run the durable side on rank 0 and share its outcome, settle (`rules.settle_boundary`),
        persist. A durable callback failure raises `DurableCheckpointError` on every rank after
        what did succeed was persisted.
        """
        before = self.trust()
        state, event = rules.agreed(self._state, self._gather_boundary(step, local_verdict, cycle_complete, finite))
        state, planned = rules.plan_boundary(state, event)
        outcome = self._execute(planned.plan)
        self._state, decision = rules.settle_boundary(state, planned, outcome)
        if self.trust() != before:
            self._persist()
        if planned.sdc_ranks or planned.nonfinite_ranks:
            logger.error("lm-resiliency certification: %s", decision.reason)
        if outcome["error"] is not None:
            raise DurableCheckpointError(f"boundary {step}: durable checkpoint callback failed on rank 0: "
                                         f"{outcome['error']}", decision)
        return decision

    def _gather_boundary(self, step: int, local_verdict: str, cycle_complete: bool,
                         finite: bool) -> List[Dict[str, Any]]:
        """Every rank's arguments, trust record and cycle counters (a rank's invalid arguments
        travel as its ``error`` so that every rank fails alike)."""
        problem = rules.boundary_problem(step, local_verdict, cycle_complete, finite)
        valid = problem is None
        return self._gather({
            "error": problem, "step": step if valid else None, "verdict": local_verdict if valid else None,
            "cycle_complete": cycle_complete if valid else None, "finite": finite,
            "catalog_size": self.catalog_size, "trust": self.trust(),
            "cycle": [self._state.cycle_seen, self._state.cycle_tainted],
        })

    def _execute(self, plan: rules.Plan) -> Dict[str, Any]:
        """Run the durable side of `plan` on rank 0 and share the outcome with every rank."""
        if self._durable is None or self._manifests is None or not plan.durable_work():
            return plan.outcome_without_durable()
        local = run_plan(self._durable.adapter, self._manifests, plan) if self._is_rank0() else {}
        return self._gather(local)[0]

    # ------------------------------------------------------------ recovery

    def note_sdc(self, step: int, reason: str) -> None:
        """Latch verified-only recovery for SDC found outside a boundary (the full replay sweep of
        `prepare_recovery`). Rank-local and non-collective, because the process group may be
        unusable; persisted, and merged job-wide at the next construction or boundary (any rank's
        latch wins)."""
        self._state = rules.sdc_noted(self._state, step)
        self._persist()
        logger.error("lm-resiliency certification: %s; recovery must use a RECOVERY_VERIFIED step (known: %s)",
                     reason, self.verified_steps())

    def resume_from(self, step: int) -> None:
        """Record that training state was just restored to `step` (call on every rank, same step).

        Drops a candidate newer than `step` and verified entries newer than `step` (the new
        timeline will overwrite those shards), restarts cycle counting, and clears the post-SDC
        latch. While SDC is pending, `step` must be a RECOVERY_VERIFIED step (fails closed).
        Non-collective; deterministic given the same trust on every rank.
        """
        self._state = rules.resumed_from(self._state, step)
        self._persist()

    def load_verified_durable(self) -> int:
        """Load the newest RECOVERY_VERIFIED durable checkpoint on every rank through the adapter's
        ``load_checkpoint`` and return its step. Collective with a group: ranks must agree on the
        manifest. Never loads a candidate or quarantined checkpoint; raises CertificationError if
        there is no verified one or a manifest is malformed or foreign. Afterwards the ledger
        resumes from that step (as `resume_from`, clearing the post-SDC latch)."""
        if self._durable is None or self._manifests is None:
            raise CertificationError("load_verified_durable: no durable_checkpoint is configured")
        checkpoint_id, step = self._agreed_newest_verified(self._manifests)
        logger.info("loading RECOVERY_VERIFIED durable checkpoint %r (step %d)", checkpoint_id, step)
        self._durable.adapter.load_checkpoint(checkpoint_id, step)
        self._state = rules.resumed(self._state, step, verified=(step, checkpoint_id))
        self._persist()
        return step

    # ------------------------------------------------------------ internals

    def _agreed_newest_verified(self, manifests: ManifestStore) -> Tuple[str, int]:
        """(checkpoint id, step) of the newest RECOVERY_VERIFIED manifest, the same on every rank
        (collective with a group)."""
        choice, error = None, None
        try:
            doc = manifests.newest_verified()
            choice = [doc["checkpoint_id"], doc["step"]]
        except (CertificationError, OSError) as exc:
            if self._group is None:
                raise
            error = f"{type(exc).__name__}: {exc}"
        views = self._gather({"error": error, "choice": choice})
        failed = [(r, v["error"]) for r, v in enumerate(views) if v["error"]]
        if failed:
            raise CertificationError("load_verified_durable: " + "; ".join(f"rank {r}: {e}" for r, e in failed))
        choices = {tuple(v["choice"]) for v in views}
        if len(choices) > 1:
            raise CertificationError(f"load_verified_durable: ranks see different newest verified durable "
                                     f"checkpoints {sorted(choices)}; manifest_dir must be shared and consistent")
        checkpoint_id, step = views[0]["choice"]
        return checkpoint_id, step

    def _gather(self, value: Dict[str, Any]) -> List[Dict[str, Any]]:
        if self._group is None:
            return [json_copy(value)]
        return all_gather_json(value, self._group)

    def _is_rank0(self) -> bool:
        return self._group is None or dist.get_rank(self._group) == 0

    def _persist(self) -> None:
        current = self._store.read_status()
        status = dict(current) if isinstance(current, dict) else {}
        status["trust"] = self.trust()
        self._store.write_status(status)
