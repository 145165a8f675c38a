"""Lightning surface: `ResiliencyCallback`, the whole integration for a Lightning `Trainer`.

    from lm_resiliency.callbacks.lightning import ResiliencyCallback
    trainer = Trainer(..., callbacks=[ResiliencyCallback(interval=10, run_id="my-run")])
    trainer.fit(model)          # after a crash, the same call resumes from the newest GEMINI step

Or with no code change: `LM_RESILIENCY=1` (or a policy-file path) in the environment adds the
callback through Lightning's `callbacks_factory` entry point (`callbacks_from_env`); the
variables and the policy file are `lm_resiliency.settings.ResiliencyPolicy`'s.

Lifecycle translation (the adapter holds the state; the session does capture/replay/recovery):

    on_fit_start              session built (collective) and recover(); recovered state handed to
                              Lightning's checkpoint connector, which restores it with its own code;
                              the RNG streams are NOT restored yet (Lightning builds dataloaders next)
    on_train_start            restored global_step verified; plain dataloaders repositioned
    on_train_batch_start      first micro-batch of an optimizer step: before_forward (after a
                              resume, the RNG streams as they were right before this batch first)
    on_before_optimizer_step  before_optimizer_step (SCOUT replay, GEMINI copy completed)
    on_train_batch_end        global_step advanced: after_optimizer_step (once per real step;
                              accumulation micro-batches do not count); SCOUT findings -> loggers
    teardown("fit")           last capture completed, session closed
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional

from lm_resiliency.attach import AttachOptions, attach
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.settings import ResiliencyPolicy
from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.reports import ReplayResult, SCOUTFaultReport
from lm_resiliency.session import ResiliencySession

logger = logging.getLogger(__name__)

METRIC_PREFIX = "lm_resiliency/"


def _callback_bases() -> tuple:
    """`lightning.pytorch.Callback` and the `pytorch_lightning.Callback` alias, whichever exist,
    so one class works with either package's Trainer."""
    bases = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found = importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:  # `lightning` itself missing
            found = False
        if found:
            bases.append(importlib.import_module(f"{package}.callbacks").Callback)
    if not bases:
        raise ImportError("lm_resiliency.callbacks.lightning needs `lightning` "
                          "(pip install 'lm-resiliency[lightning]')")
    return tuple(bases)


# mypy cannot follow a base list computed at import (Lightning's Callback, from either package).
class ResiliencyCallback(*_callback_bases()):  # type: ignore[misc]
    """GEMINI in-memory checkpoints and SCOUT checks for a Lightning `Trainer`.

    Arguments mirror `enable_resiliency`: `interval` (shared capture/check cadence; overrides
    `checkpoint.interval` and `replay.check_interval`), `checkpoint` (`InMemoryCkptConfig`),
    `replay` (`ReplayHarnessConfig`), `enable_checkpoint`, `enable_detection`, `recovery_mode`,
    `orchestration`, `fault_callback`, `oob_fault_callback`, `durable_checkpoint`,
    `extra_state_fn` / `load_extra_state_fn` (state Lightning does not own). Lightning-specific:
    `run_id` (the identity a restarted job must share to recover; also via
    LM_RESILIENCY_RUN_ID or torchrun's run id), `disk_folder` (shortcut for
    `checkpoint.disk_folder`) and `log_metrics` (SCOUT and GEMINI metrics to the Trainer's loggers).
    """

    def __init__(self, interval: Optional[int] = None, checkpoint: Optional[InMemoryCkptConfig] = None,
                 replay: Optional[ReplayHarnessConfig] = None, *, enable_checkpoint: bool = True,
                 enable_detection: bool = True, run_id: Optional[str] = None, disk_folder: Optional[str] = None,
                 recovery_mode: "RecoveryMode | str | None" = None, orchestration: Any = None,
                 extra_state_fn: Optional[Callable[[], Dict[str, Any]]] = None,
                 load_extra_state_fn: Optional[Callable[[Dict[str, Any]], None]] = None,
                 fault_callback: Optional[Callable[[ReplayResult], None]] = None,
                 oob_fault_callback: Optional[Callable[[SCOUTFaultReport], None]] = None,
                 durable_checkpoint: Any = None, log_metrics: bool = True) -> None:
        for name, value in (("enable_checkpoint", enable_checkpoint), ("enable_detection", enable_detection),
                            ("log_metrics", log_metrics)):
            if not isinstance(value, bool):
                raise TypeError(f"ResiliencyCallback({name}=...): must be True or False, got {value!r}")
        options = AttachOptions(
            interval=interval, checkpoint=checkpoint, replay=replay, enable_checkpoint=enable_checkpoint,
            enable_detection=enable_detection, extra_state_fn=extra_state_fn, load_extra_state_fn=load_extra_state_fn,
            recovery_mode=recovery_mode, orchestration=orchestration, durable_checkpoint=durable_checkpoint,
            fault_callback=self._on_replay_fault, oob_fault_callback=self._on_oob_fault, caller="ResiliencyCallback")
        if run_id is not None:
            options = options.replace(checkpoint=dataclasses.replace(options.config, run_id=run_id))
        if disk_folder is not None:
            folder = os.fspath(disk_folder)
            options = options.replace(checkpoint=dataclasses.replace(options.config, disk_folder=folder))
        self._options = options
        self._user_fault_callback = fault_callback
        self._user_oob_fault_callback = oob_fault_callback
        self._log_metrics = log_metrics
        self.from_entry_point = False
        self.session: Optional[ResiliencySession] = None
        self.adapter: Any = None
        self.recovered_step: Optional[int] = None
        self.topology: Any = None  # the adapter's Topology of the last fit
        self.captured_step = -1    # newest complete GEMINI capture when training ended (the last one
        #                            completes at teardown)
        self._active = True
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._last_global_step = 0
        self._window_open = False
        self._logged_result: Optional[ReplayResult] = None
        self._logged_gemini_step = -1
        self._oob_lock = threading.Lock()
        self._oob_reports: List[SCOUTFaultReport] = []

    @property
    def config(self) -> InMemoryCkptConfig:
        return self._options.config

    def __getstate__(self) -> dict:
        # ddp_spawn pickles the Trainer with its callbacks; a live session never travels.
        state = self.__dict__.copy()
        state.update(session=None, adapter=None, _oob_lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._oob_lock = threading.Lock()

    # ----------------------------------------------------------------- setup

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        from lm_resiliency.adapters.lightning import strategy_kind

        mine = [cb for cb in trainer.callbacks if isinstance(cb, ResiliencyCallback)]
        explicit = [cb for cb in mine if not cb.from_entry_point]
        if len(explicit) > 1:
            raise RuntimeError(f"Trainer(callbacks=...) holds {len(explicit)} ResiliencyCallback instances; one "
                               "callback protects the whole run, pass exactly one")
        # An explicit callback wins over the one the LM_RESILIENCY entry point added.
        self._active = self is (explicit or mine)[0]
        if not self._active:
            logger.info("lm-resiliency: the entry-point ResiliencyCallback is inactive; an explicit one is configured")
            return
        strategy_kind(trainer)  # a clear error before anything runs

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._active:
            return
        from lm_resiliency.adapters.lightning import LightningAdapter

        self._close_session()
        self._reset_run_state()
        self.recovered_step = None
        adapter = LightningAdapter(trainer, skip_replication_if_hsdp=self.config.skip_replication_if_hsdp)
        self.session = attach(adapter, self._options, recover=lambda session: self._recover(trainer, session, adapter))
        self.adapter = adapter

    def _recover(self, trainer: Any, session: ResiliencySession, adapter: Any) -> None:
        self.topology = adapter.topology()
        if int(trainer.global_step) > 0:
            # A second fit() on a live Trainer continues from its in-memory state, which is
            # newer than anything GEMINI holds.
            logger.info("lm-resiliency: continuing the live Trainer at global_step %d; no recovery",
                        trainer.global_step)
            return
        with session.checkpoint_io("read", name="gemini_recover"):
            step = session.recover()
        if session.recovered_from == "gemini":
            adapter.hand_to_lightning()
            self.recovered_step = step

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.session is None:
            return
        self.adapter.on_train_start()
        if self.session.recovered_from != "gemini":
            # Fresh, or Lightning loaded a ckpt_path (the durable fallback): count from its step.
            self.session.continue_from(int(trainer.global_step))
        self._last_global_step = int(trainer.global_step)
        self._window_open = False
        if self.recovered_step is not None:
            self._emit(trainer, {"recovered_step": float(self.recovered_step)})

    # ------------------------------------------------------------- step hooks

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.session is None or self._window_open:
            return
        self._window_open = True  # later micro-batches of this optimizer step are not new forwards
        self.adapter.before_batch()
        self.adapter.step_callbacks.before_forward()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.session is not None:
            self.adapter.step_callbacks.before_optimizer_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        session = self.session
        if session is None:
            return
        step = int(trainer.global_step)
        if step > self._last_global_step:
            for _ in range(step - self._last_global_step):
                self.adapter.step_callbacks.after_optimizer_step()
            self._last_global_step = step
            self._window_open = False
            if session.capture_due():
                self.adapter.mark_boundary()
        if self._log_metrics:
            self._log_findings(trainer, session)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.session is not None:
            self.captured_step = self.session.latest_gemini_step

    # -------------------------------------------------------------- teardown

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        session = self.session
        if session is None:
            return
        try:
            # This launch ends abnormally: keep the host slots for the relaunch and stop replicating
            # now, so no rank waits timeout_s on an exchange with a peer stuck in a training collective.
            session.keep_state_for_relaunch()
            step = session.flush_for_restart()
            logger.warning("lm-resiliency: %s during fit; GEMINI step %d is on node-local disk for the restart",
                           type(exception).__name__, step)
        except Exception:  # the training exception must surface, not this one
            logger.exception("lm-resiliency: flushing GEMINI state after %s failed", type(exception).__name__)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close_session()

    def _close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()
        self.adapter = None

    # --------------------------------------------------------------- metrics

    def _on_replay_fault(self, result: ReplayResult) -> None:
        if self._user_fault_callback is not None:
            self._user_fault_callback(result)

    def _on_oob_fault(self, report: SCOUTFaultReport) -> None:
        # Runs on SCOUT's monitor thread: queue it for the training thread's next log point.
        with self._oob_lock:
            self._oob_reports.append(report)
        if self._user_oob_fault_callback is not None:
            self._user_oob_fault_callback(report)

    def _log_findings(self, trainer: Any, session: ResiliencySession) -> None:
        metrics: Dict[str, float] = {}
        result = session.last_replay_result
        if result is not None and result is not self._logged_result:
            self._logged_result = result
            metrics.update(replay_metrics(result))
        captured = session.latest_gemini_step
        if captured != self._logged_gemini_step and captured >= 0:
            self._logged_gemini_step = captured
            metrics["gemini_captured_step"] = float(captured)
        with self._oob_lock:
            reports, self._oob_reports = self._oob_reports, []
        if reports:
            metrics.update(oob_metrics(reports))
        if metrics:
            self._emit(trainer, metrics)

    def _emit(self, trainer: Any, metrics: Dict[str, float]) -> None:
        named = {METRIC_PREFIX + key: value for key, value in metrics.items()}
        for lightning_logger in trainer.loggers:
            lightning_logger.log_metrics(named, step=trainer.global_step)


def replay_metrics(result: ReplayResult) -> Dict[str, float]:
    """Logger metrics for one SCOUT replay result (same on every rank of the check)."""
    faulty = sorted({rank for check in result.checks for rank in check.faulty})
    slow = [finding for finding in result.stragglers if finding.confirmed]
    metrics = {
        "scout_checks": float(len(result.checks)),
        "scout_healthy": 1.0 if result.healthy else 0.0,
        "scout_sdc": 1.0 if result.sdc else 0.0,
        "scout_inconclusive": 1.0 if result.inconclusive else 0.0,
        "scout_suspect_ranks": float(len(faulty)),
        "scout_stragglers": float(len(slow)),
    }
    for rank in faulty:
        metrics[f"scout_sdc_rank_{rank}"] = 1.0
    for finding in slow:
        for rank in finding.ranks:
            metrics[f"scout_{finding.kind}_straggler_rank_{rank}"] = float(finding.slowdown)
    return metrics


def oob_metrics(reports: List[SCOUTFaultReport]) -> Dict[str, float]:
    """Logger metrics for out-of-band reports (hang, dataloader stall, checkpoint I/O stall)."""
    metrics: Dict[str, float] = {"oob_faults": float(len(reports))}
    for report in reports:
        metrics[f"oob_{report.kind}"] = metrics.get(f"oob_{report.kind}", 0.0) + 1.0
        for rank in report.ranks:
            metrics[f"oob_{report.kind}_rank_{rank}"] = 1.0
    return metrics


# ------------------------------------------------------------ zero-code opt-in


def callbacks_from_env() -> List[Any]:
    """Entry point for `lightning.pytorch.callbacks_factory` (and `pytorch_lightning.callbacks_factory`):
    a ResiliencyCallback when LM_RESILIENCY is set, otherwise nothing. The variables and policy
    files are `lm_resiliency.settings.ResiliencyPolicy`'s, shared with the Accelerate flag."""
    policy = ResiliencyPolicy.from_environment()
    if policy is None:
        return []
    callback = ResiliencyCallback(**policy.arguments())
    callback.from_entry_point = True
    return [callback]


__all__ = ["ResiliencyCallback", "callbacks_from_env", "replay_metrics", "oob_metrics"]
