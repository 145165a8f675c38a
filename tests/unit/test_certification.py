"""SCOUT checkpoint certification (single process) and the manager API's orchestration hooks."""

import json
import os
import stat

import pytest

from lm_resiliency.config import ConfigError
from lm_resiliency.gemini.storage import NodeLocalStore
from lm_resiliency.recovery import RecoveryDecision, RecoveryMode
from lm_resiliency.trust import (
    CANDIDATE, LATEST_VERIFIED_FILE, QUARANTINED, RECOVERY_VERIFIED, CallbackDurableCheckpointAdapter,
    CertificationError, CertificationLedger, DurableCheckpointConfig, DurableCheckpointError, ManifestRejected,
    manifest_name, verdict_of,
)
from lm_resiliency.scout.reports import CheckOutcome, ReplayResult, SCOUTFaultReport, StragglerFinding

ENV = "env-1"


def make_store(tmp_path):
    return NodeLocalStore(str(tmp_path / "nl"), "run", "topo", 0, verify_integrity=False)


class Recorder:
    """A framework checkpoint store that records every callback."""

    def __init__(self, fail=None):
        self.calls = []
        self.saved = 0
        self.fail = fail

    def save(self, step):
        self.calls.append(("save", step))
        if self.fail == "save":
            raise OSError("disk full")
        self.saved += 1
        return f"ckpt-{step}-{self.saved}"

    def load(self, checkpoint_id, step):
        self.calls.append(("load", checkpoint_id, step))

    def commit(self, checkpoint_id, step):
        self.calls.append(("commit", checkpoint_id, step))
        if self.fail == "commit":
            raise OSError("commit failed")

    def quarantine(self, checkpoint_id, step, reason):
        self.calls.append(("quarantine", checkpoint_id, step, reason))

    def adapter(self):
        return CallbackDurableCheckpointAdapter(save_candidate_fn=self.save, load_checkpoint_fn=self.load,
                                                commit_candidate_fn=self.commit,
                                                quarantine_candidate_fn=self.quarantine)


def durable(tmp_path, recorder, env=ENV):
    return DurableCheckpointConfig(manifest_dir=str(tmp_path / "manifests"), environment_id=env,
                                   adapter=recorder.adapter())


def run_cycle(ledger, first_step, k, verdicts=None, interval=10):
    """One K-recipe cycle of boundaries; returns the decisions."""
    verdicts = verdicts or ["clean"] * k
    return [ledger.boundary(first_step + i * interval, verdicts[i], i == k - 1) for i in range(k)]


def read_manifest(tmp_path, name):
    with open(tmp_path / "manifests" / name) as f:
        return json.load(f)


# ---------------------------------------------------------------------------- dense


def test_dense_accepted_boundary_is_verified_at_once(tmp_path):
    ledger = CertificationLedger(1, make_store(tmp_path))
    d = ledger.boundary(10, "clean", True)
    assert d.capture and d.state == RECOVERY_VERIFIED and d.verified_step == 10 and d.cycle_complete
    assert ledger.recovery_verified_step == 10 and ledger.candidate_step is None
    d = ledger.boundary(20, "straggler", True)
    assert d.capture and d.verified_step == 20 and d.verdict == "straggler"
    assert ledger.verified_steps() == [20, 10]


def test_dense_sdc_vetoes_capture_and_latches_until_verified_resume(tmp_path):
    ledger = CertificationLedger(1, make_store(tmp_path))
    ledger.boundary(10, "clean", True)
    d = ledger.boundary(20, "sdc", True)
    assert not d.capture and d.sdc_detected and d.requires_verified_recovery and d.verified_step is None
    assert ledger.recovery_verified_step == 10 and ledger.sdc_detected_step == 20
    # Post-SDC state is never certified, even if replay looks clean again.
    d = ledger.boundary(30, "clean", True)
    assert not d.capture and d.state is None and ledger.verified_steps() == [10]
    with pytest.raises(CertificationError, match="RECOVERY_VERIFIED step"):
        ledger.resume_from(30)
    ledger.resume_from(10)
    assert not ledger.requires_verified_recovery
    d = ledger.boundary(20, "clean", True)
    assert d.capture and d.verified_step == 20 and ledger.sdc_detected_step == 20


def test_inconclusive_and_incomplete_block_certification_without_marking_sdc(tmp_path):
    ledger = CertificationLedger(1, make_store(tmp_path))
    for step, verdict in ((10, "inconclusive"), (20, "incomplete")):
        d = ledger.boundary(step, verdict, True)
        assert not d.capture and d.verified_step is None and not d.sdc_detected
        assert not d.requires_verified_recovery
    assert ledger.verified_steps() == [] and ledger.sdc_detected_step is None
    assert ledger.boundary(30, "clean", True).verified_step == 30


# ---------------------------------------------------------------------------- dynamic


def test_two_cycle_candidate_protocol_promotes_and_rejects(tmp_path):
    rec = Recorder()
    ledger = CertificationLedger(3, make_store(tmp_path), durable=durable(tmp_path, rec))

    # Cycle 1 clean: its last boundary becomes candidate A; nothing verified yet.
    c1 = run_cycle(ledger, 10, 3)
    assert all(d.capture for d in c1)
    assert [d.state for d in c1] == [None, None, CANDIDATE]
    assert c1[-1].cycle_complete and c1[-1].verified_step is None
    assert ledger.candidate_step == 30 and ledger.recovery_verified_step is None
    id_a = ledger.candidate_checkpoint_id
    assert rec.calls == [("save", 30)] and id_a == "ckpt-30-1"

    # Mid-cycle boundaries never promote.
    d = ledger.boundary(40, "clean", False)
    assert d.verified_step is None and ledger.candidate_step == 30

    # Cycle 2 clean: A -> RECOVERY_VERIFIED, B (step 60) becomes the candidate.
    d = ledger.boundary(50, "straggler", False)
    assert d.capture
    d = ledger.boundary(60, "clean", True)
    assert d.verified_step == 30 and d.state == CANDIDATE and d.candidate_step == 60
    assert ledger.recovery_verified_step == 30 and ledger.recovery_verified_checkpoint_id == id_a
    id_b = ledger.candidate_checkpoint_id
    assert rec.calls[1:] == [("commit", id_a, 30), ("save", 60)] and id_b == "ckpt-60-2"

    # Cycle 3: SDC at its second recipe rejects B, keeps A, vetoes the capture.
    assert ledger.boundary(70, "clean", False).capture
    d = ledger.boundary(80, "sdc", False)
    assert not d.capture and d.rejected_step == 60 and d.sdc_detected and d.requires_verified_recovery
    assert d.candidate_step is None
    assert ledger.recovery_verified_step == 30 and ledger.candidate_step is None
    assert ledger.sdc_detected_step == 80
    assert rec.calls[3][:3] == ("quarantine", id_b, 60) and "SDC" in rec.calls[3][3]
    # The rest of the tainted cycle certifies nothing.
    d = ledger.boundary(90, "clean", True)
    assert not d.capture and d.state is None and len(rec.calls) == 4

    assert read_manifest(tmp_path, manifest_name(id_a))["state"] == RECOVERY_VERIFIED
    assert read_manifest(tmp_path, manifest_name(id_b))["state"] == QUARANTINED
    assert read_manifest(tmp_path, LATEST_VERIFIED_FILE)["checkpoint_id"] == id_a


def test_inconclusive_cycle_retires_candidate_and_restarts_protocol(tmp_path):
    rec = Recorder()
    ledger = CertificationLedger(2, make_store(tmp_path), durable=durable(tmp_path, rec))
    run_cycle(ledger, 10, 2)
    assert ledger.candidate_step == 20
    c2 = run_cycle(ledger, 30, 2, ["inconclusive", "clean"])
    assert [d.capture for d in c2] == [False, True]
    assert c2[-1].verified_step is None and c2[-1].rejected_step == 20 and not c2[-1].sdc_detected
    assert ledger.candidate_step is None and ledger.recovery_verified_step is None
    assert ledger.sdc_detected_step is None and not ledger.requires_verified_recovery
    assert rec.calls[-1][0] == "quarantine" and "not certified" in rec.calls[-1][3]
    c3 = run_cycle(ledger, 50, 2)
    assert c3[-1].state == CANDIDATE and c3[-1].verified_step is None and ledger.candidate_step == 60
    c4 = run_cycle(ledger, 70, 2)
    assert c4[-1].verified_step == 60 and ledger.candidate_step == 80


def test_cycle_joined_midway_does_not_count(tmp_path):
    ledger = CertificationLedger(3, make_store(tmp_path))
    ledger.boundary(20, "clean", False)
    d = ledger.boundary(30, "clean", True)
    assert d.capture and not d.cycle_complete and d.state is None and ledger.candidate_step is None
    assert run_cycle(ledger, 40, 3)[-1].state == CANDIDATE


def test_rollback_drops_abandoned_candidate(tmp_path):
    ledger = CertificationLedger(2, make_store(tmp_path))
    run_cycle(ledger, 10, 2)
    run_cycle(ledger, 30, 2)
    assert ledger.verified_steps() == [20] and ledger.candidate_step == 40
    ledger.resume_from(20)
    assert ledger.candidate_step is None and ledger.verified_steps() == [20]
    # Without resume_from, a boundary step at or before the previous one is detected too.
    run_cycle(ledger, 30, 2)
    assert ledger.candidate_step == 40
    ledger.boundary(30, "clean", False)
    assert ledger.candidate_step is None


# ---------------------------------------------------------------------------- persistence


def test_restart_on_same_storage_keeps_verified_and_sdc(tmp_path):
    store = make_store(tmp_path)
    store.write_status({"latest_step": 55, "own_steps": [50, 55]})
    rec = Recorder()
    ledger = CertificationLedger(2, store, durable=durable(tmp_path, rec))
    run_cycle(ledger, 10, 2)
    run_cycle(ledger, 30, 2)
    ledger.boundary(50, "sdc", False)

    status = make_store(tmp_path).read_status()
    assert status["latest_step"] == 55 and status["own_steps"] == [50, 55]   # other keys kept
    trust = status["trust"]
    assert trust["recovery_verified_step"] == 20 and trust["candidate_step"] is None
    assert trust["sdc_detected_step"] == 50 and trust["catalog_size"] == 2
    assert [e["step"] for e in trust["verified_history"]] == [20]

    again = CertificationLedger(2, make_store(tmp_path), durable=durable(tmp_path, Recorder()))
    assert again.recovery_verified_step == 20 and again.sdc_detected_step == 50
    assert again.candidate_step is None and again.requires_verified_recovery
    assert again.recovery_verified_checkpoint_id == ledger.recovery_verified_checkpoint_id
    # The restarted job cannot certify past the SDC without a verified resume.
    assert not again.boundary(60, "clean", False).capture


def test_persisted_candidate_survives_restart_and_is_promoted(tmp_path):
    ledger = CertificationLedger(2, make_store(tmp_path))
    run_cycle(ledger, 10, 2)
    again = CertificationLedger(2, make_store(tmp_path))
    assert again.candidate_step == 20
    assert run_cycle(again, 30, 2)[-1].verified_step == 20


def test_history_is_bounded(tmp_path):
    ledger = CertificationLedger(1, make_store(tmp_path))
    for step in range(10, 210, 10):
        ledger.boundary(step, "clean", True)
    assert ledger.verified_steps() == list(range(200, 120, -10))


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t.update(schema_version=99), "schema_version"),
    (lambda t: t.update(recovery_verified_step=30), "recovery_verified_step"),
    (lambda t: t.update(sdc_pending="no"), "sdc_pending"),
    (lambda t: t.pop("verified_history"), "keys"),
    (lambda t: t.update(verified_history=[{"step": 10, "checkpoint_id": None},
                                          {"step": 20, "checkpoint_id": None}]), "newest first"),
])
def test_corrupt_persisted_trust_fails_closed(tmp_path, mutate, match):
    store = make_store(tmp_path)
    ledger = CertificationLedger(1, store)
    ledger.boundary(10, "clean", True)
    status = store.read_status()
    mutate(status["trust"])
    store.write_status(status)
    with pytest.raises(CertificationError, match=match):
        CertificationLedger(1, store)


# ---------------------------------------------------------------------------- durable manifests


def test_manifests_are_atomic_owner_only_and_complete(tmp_path):
    rec = Recorder()
    ledger = CertificationLedger(2, make_store(tmp_path), durable=durable(tmp_path, rec))
    run_cycle(ledger, 10, 2)
    run_cycle(ledger, 30, 2)
    directory = tmp_path / "manifests"
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    names = sorted(os.listdir(directory))
    assert not [n for n in names if n.startswith(".")]           # no temporary files left behind
    assert names == sorted([manifest_name("ckpt-20-1"), manifest_name("ckpt-40-2"), LATEST_VERIFIED_FILE])
    for name in names:
        assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o600
    doc = read_manifest(tmp_path, manifest_name("ckpt-20-1"))
    assert {k: doc[k] for k in ("checkpoint_id", "step", "state", "environment_id")} == {
        "checkpoint_id": "ckpt-20-1", "step": 20, "state": RECOVERY_VERIFIED, "environment_id": ENV}
    assert isinstance(doc["updated_at"], float)
    assert read_manifest(tmp_path, manifest_name("ckpt-40-2"))["state"] == CANDIDATE
    assert read_manifest(tmp_path, LATEST_VERIFIED_FILE) == doc


def test_dense_durable_saves_then_commits(tmp_path):
    rec = Recorder()
    ledger = CertificationLedger(1, make_store(tmp_path), durable=durable(tmp_path, rec))
    d = ledger.boundary(10, "clean", True)
    assert rec.calls == [("save", 10), ("commit", "ckpt-10-1", 10)]
    assert d.checkpoint_id == "ckpt-10-1" and ledger.recovery_verified_checkpoint_id == "ckpt-10-1"
    assert read_manifest(tmp_path, manifest_name("ckpt-10-1"))["state"] == RECOVERY_VERIFIED


def test_load_verified_durable_never_loads_a_candidate(tmp_path):
    rec = Recorder()
    ledger = CertificationLedger(2, make_store(tmp_path), durable=durable(tmp_path, rec))
    with pytest.raises(CertificationError, match="does not exist"):
        ledger.load_verified_durable()
    run_cycle(ledger, 10, 2)                       # candidate only
    with pytest.raises(CertificationError, match="no RECOVERY_VERIFIED"):
        ledger.load_verified_durable()
    assert not [c for c in rec.calls if c[0] == "load"]
    run_cycle(ledger, 30, 2)                       # 20 verified, 40 candidate
    run_cycle(ledger, 50, 2)                       # 40 verified, 60 candidate
    ledger.boundary(70, "sdc", False)              # 60 quarantined
    assert ledger.load_verified_durable() == 40
    assert rec.calls[-1] == ("load", "ckpt-40-2", 40)
    assert not ledger.requires_verified_recovery and ledger.candidate_step is None


def test_tampered_environment_id_is_rejected(tmp_path):
    rec = Recorder()
    ledger = CertificationLedger(1, make_store(tmp_path), durable=durable(tmp_path, rec))
    ledger.boundary(10, "clean", True)
    path = tmp_path / "manifests" / manifest_name("ckpt-10-1")
    doc = json.loads(path.read_text())
    doc["environment_id"] = "another-job"
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestRejected, match="environment"):
        ledger.load_verified_durable()
    # A job in another environment refuses even the untouched pointer.
    other = CertificationLedger(1, NodeLocalStore(str(tmp_path / "nl2"), "run", "topo", 0, verify_integrity=False),
                                durable=durable(tmp_path, Recorder(), env="env-2"))
    with pytest.raises(ManifestRejected, match="environment"):
        other.load_verified_durable()
    assert not [c for c in rec.calls if c[0] == "load"]


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(state="TRUSTED"), "state"),
    (lambda d: d.pop("step"), "keys"),
    (lambda d: d.update(step=-1), "step"),
    (lambda d: d.update(checkpoint_id="other"), "file name"),
])
def test_malformed_manifest_fails_closed(tmp_path, edit, match):
    ledger = CertificationLedger(1, make_store(tmp_path), durable=durable(tmp_path, Recorder()))
    ledger.boundary(10, "clean", True)
    path = tmp_path / "manifests" / manifest_name("ckpt-10-1")
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestRejected, match=match):
        ledger.load_verified_durable()


def test_fifo_named_like_a_manifest_is_refused_without_blocking(tmp_path):
    ledger = CertificationLedger(1, make_store(tmp_path), durable=durable(tmp_path, Recorder()))
    ledger.boundary(10, "clean", True)
    path = tmp_path / "manifests" / manifest_name("ckpt-10-1")
    path.unlink()
    os.mkfifo(path, 0o600)  # a blocking open would wait for a writer forever
    with pytest.raises(ManifestRejected, match="not a regular file"):
        ledger.load_verified_durable()


def test_pointer_to_a_non_verified_manifest_is_rejected(tmp_path):
    rec = Recorder()
    ledger = CertificationLedger(1, make_store(tmp_path), durable=durable(tmp_path, rec))
    ledger.boundary(10, "clean", True)
    ledger.boundary(20, "clean", True)
    path = tmp_path / "manifests" / manifest_name("ckpt-20-2")
    doc = json.loads(path.read_text())
    doc["state"] = QUARANTINED
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestRejected, match="ambiguous"):
        ledger.load_verified_durable()
    assert not [c for c in rec.calls if c[0] == "load"]


def test_durable_failure_raises_with_decision_and_fails_closed(tmp_path):
    rec = Recorder(fail="save")
    ledger = CertificationLedger(2, make_store(tmp_path), durable=durable(tmp_path, rec))
    ledger.boundary(10, "clean", False)
    with pytest.raises(DurableCheckpointError, match="disk full") as info:
        ledger.boundary(20, "clean", True)
    assert info.value.decision.capture and info.value.decision.state is None
    assert ledger.candidate_step is None


def test_commit_failure_does_not_promote(tmp_path):
    rec = Recorder()
    ledger = CertificationLedger(2, make_store(tmp_path), durable=durable(tmp_path, rec))
    run_cycle(ledger, 10, 2)
    rec.fail = "commit"
    with pytest.raises(DurableCheckpointError, match="commit failed"):
        run_cycle(ledger, 30, 2)
    assert ledger.recovery_verified_step is None and ledger.candidate_step is None
    assert read_manifest(tmp_path, manifest_name("ckpt-20-1"))["state"] == CANDIDATE


def test_reused_verified_id_is_refused(tmp_path):
    ledger = CertificationLedger(1, make_store(tmp_path), durable=DurableCheckpointConfig(
        str(tmp_path / "manifests"), ENV, CallbackDurableCheckpointAdapter(
            lambda step: "same", lambda i, s: None, lambda i, s: None, lambda i, s, r: None)))
    ledger.boundary(10, "clean", True)
    with pytest.raises(DurableCheckpointError, match="unique"):
        ledger.boundary(20, "clean", True)
    assert ledger.verified_steps() == []
    assert read_manifest(tmp_path, manifest_name("same"))["state"] == QUARANTINED
    assert not os.path.exists(tmp_path / "manifests" / LATEST_VERIFIED_FILE)


# ---------------------------------------------------------------------------- validation


def test_durable_config_validation_names_the_field(tmp_path):
    adapter = Recorder().adapter()
    with pytest.raises(ConfigError, match="DurableCheckpointConfig.manifest_dir"):
        DurableCheckpointConfig("", ENV, adapter)
    with pytest.raises(ConfigError, match="DurableCheckpointConfig.environment_id"):
        DurableCheckpointConfig(str(tmp_path), "", adapter)
    with pytest.raises(ConfigError, match="DurableCheckpointConfig.adapter.*quarantine_candidate"):
        DurableCheckpointConfig(str(tmp_path), ENV, object())
    with pytest.raises(ConfigError, match="CallbackDurableCheckpointAdapter.commit_candidate_fn"):
        CallbackDurableCheckpointAdapter(print, print, None, print)
    assert DurableCheckpointConfig(tmp_path, ENV, adapter).manifest_dir == str(tmp_path)


def test_ledger_validation(tmp_path):
    with pytest.raises(ConfigError, match="catalog_size"):
        CertificationLedger(0, make_store(tmp_path))
    with pytest.raises(ConfigError, match="status_store"):
        CertificationLedger(1, object())
    ledger = CertificationLedger(1, make_store(tmp_path))
    with pytest.raises(CertificationError, match="local_verdict"):
        ledger.boundary(10, "fine", True)
    with pytest.raises(CertificationError, match="cycle_complete"):
        ledger.boundary(10, "clean", 1)


def test_verdict_of_replay_results():
    clean = CheckOutcome("hidden", "layers.0", (0, 1, 2), {0: "a", 1: "a", 2: "a"}, "clean")
    sdc = CheckOutcome("hidden", "layers.0", (0, 1, 2), {0: "a", 1: "a", 2: "b"}, "sdc", faulty=(2,))
    slow = StragglerFinding("compute", (1,), ("h1",), 3.0, True, 0.9)
    assert verdict_of(None) == "incomplete"
    assert verdict_of(ReplayResult(10, (clean,))) == "clean"
    assert verdict_of(ReplayResult(10, (clean,), (slow,))) == "straggler"
    assert verdict_of(ReplayResult(10, (sdc,), (slow,))) == "sdc"


# ---------------------------------------------------------------------------- manager API


def test_manager_api_exports_only_what_exists():
    import lm_resiliency.manager_api as manager_api

    assert set(manager_api.__all__) == {
        "OrchestrationHooks", "RestartDestinationResolver", "RecoveryDecision", "RecoveryDecisionCallback",
        "SCOUTFaultReport", "SCOUTFaultCallback", "replay_fault_reports", "dispatch_replay_faults",
        "HealthConfig", "HardwareHealthMonitor", "HealthEvent", "HealthReading", "HealthSeverity", "HealthSource",
        "NvmlSource", "local_fingerprint", "find_drift", "format_drift", "make_transfer", "CheckpointTransfer",
        "TransferMetadataStore", "TransferKey", "TransferReceipt", "TransferRefused", "TransferBackendUnavailable"}
    assert len(manager_api.__all__) == 25
    for name in manager_api.__all__:
        assert getattr(manager_api, name) is not None


def test_orchestration_hooks_validation():
    from lm_resiliency.manager_api import OrchestrationHooks

    OrchestrationHooks()
    OrchestrationHooks(report_fault=print, report_recovery=print, restart_destination=lambda: None)
    for field in ("report_fault", "report_recovery", "restart_destination"):
        with pytest.raises(ConfigError, match=f"OrchestrationHooks.{field}"):
            OrchestrationHooks(**{field: "not callable"})


def _events():
    events = []
    from lm_resiliency.manager_api import OrchestrationHooks

    hooks = OrchestrationHooks(report_fault=lambda r: events.append(("fault", r)),
                               report_recovery=lambda d: events.append(("recovery", d)))
    return events, hooks


def test_dispatch_sdc_reports_recovery_before_faults():
    from lm_resiliency.manager_api import dispatch_replay_faults

    events, hooks = _events()
    sdc = CheckOutcome("hidden", "layers.3", (0, 1, 2), {0: "a", 1: "b", 2: "a"}, "sdc", faulty=(1,),
                       hosts={1: "node-1"})
    slow = StragglerFinding("compute", (2,), ("node-2",), 2.5, True, 0.8)
    seen_modes = []

    def step_source(mode):
        seen_modes.append(mode)
        return 40, "node_local", "ckpt-40"

    reports = dispatch_replay_faults(ReplayResult(77, (sdc,), (slow,)), hooks, topology="topo-x",
                                     step_source=step_source)
    assert [kind for kind, _ in events] == ["recovery", "fault", "fault"]
    decision = events[0][1]
    assert isinstance(decision, RecoveryDecision)
    assert decision.mode == RecoveryMode.RECOVERY_VERIFIED.value and decision.failure == "sdc"
    assert (decision.step, decision.source, decision.durable_checkpoint_id) == (40, "node_local", "ckpt-40")
    assert decision.topology == "topo-x" and decision.available
    json.dumps(decision.to_json())
    assert seen_modes == [RecoveryMode.RECOVERY_VERIFIED]
    assert [r for _, r in events[1:]] == reports
    assert all(isinstance(r, SCOUTFaultReport) for r in reports)
    assert {r.kind for r in reports} == {"sdc", "compute_straggler"}


def test_dispatch_straggler_is_latest_and_healthy_sends_nothing():
    from lm_resiliency.manager_api import dispatch_replay_faults

    events, hooks = _events()
    slow = StragglerFinding("communication", (3,), ("node-3",), 4.0, True, 0.7)
    reports = dispatch_replay_faults(ReplayResult(12, (), (slow,)), hooks)
    assert [kind for kind, _ in events] == ["recovery", "fault"]
    decision = events[0][1]
    assert decision.mode == RecoveryMode.LATEST.value and decision.failure == "straggler"
    assert decision.step is None and not decision.available and "no checkpoint lookup" in decision.reason
    assert len(reports) == 1

    events.clear()
    unconfirmed = StragglerFinding("compute", (3,), ("node-3",), 1.6, False, 0.3)
    assert dispatch_replay_faults(ReplayResult(13, (), (unconfirmed,)), hooks) == []
    assert events == []


def test_dispatch_lookup_failure_is_reported_not_swallowed():
    from lm_resiliency.manager_api import dispatch_replay_faults

    events, hooks = _events()
    inconclusive = CheckOutcome("output", "head", (0, 1, 2), {0: "a", 1: "b", 2: "c"}, "inconclusive")

    def broken(mode):
        raise RuntimeError("process group is gone")

    dispatch_replay_faults(ReplayResult(5, (inconclusive,)), hooks, step_source=broken)
    decision = events[0][1]
    assert decision.mode == RecoveryMode.RECOVERY_VERIFIED.value and decision.failure == "uncertain"
    assert not decision.available and "process group is gone" in decision.reason
    assert events[1][1].kind == "sdc_inconclusive"
