"""What orchestration receives is JSON-ready: `RecoveryDecision` and `SCOUTFaultReport` are their
JSON documents (``json.dumps`` works, keys index them), read-only, with typed attribute access;
`prepare_recovery` returns the `RecoveryMode` a relaunch passes as ``recovery_mode=``."""

import copy
import dataclasses
import json
import pickle

import pytest
import torch

from lm_resiliency import (InMemoryCkptConfig, RecoveryDecision, RecoveryMode, SCOUTFaultReport, enable_resiliency,
                           replay_fault_reports)
from lm_resiliency.gemini.manager import RecoveryUnavailable
from lm_resiliency.manager_api import OrchestrationHooks, dispatch_replay_faults
from lm_resiliency.scout.reports import CheckOutcome, ReplayResult, StragglerFinding


def _wire(payload):
    """What a manager forwarding `payload` to a control plane sends, read back."""
    return json.loads(json.dumps(payload, allow_nan=False))


def _check(verdict, faulty=()):
    return CheckOutcome(check="hidden", module_path="layers.1", group_ranks=(0, 1, 2),
                        signatures={0: "aa", 1: "bb" if verdict != "clean" else "aa", 2: "aa"}, verdict=verdict,
                        faulty=faulty, hosts={0: "h0", 1: "h1", 2: "h2"})


RESULTS = {
    "sdc": ReplayResult(step=8, checks=(_check("sdc", (1,)),)),
    "peer_group": ReplayResult(step=8, checks=(_check("peer_group"),)),
    "inconclusive": ReplayResult(step=8, checks=(_check("inconclusive"),)),
    "straggler": ReplayResult(step=8, stragglers=(StragglerFinding(
        kind="communication", ranks=(2,), hosts=("h2",), slowdown=float("inf"), confirmed=True, confidence=0.9,
        evidence={"groups": ((0, 2), (1, 2)), "endpoint_rank": 2}),)),
}


@pytest.mark.parametrize("case", sorted(RESULTS))
def test_every_decision_and_report_dispatched_to_orchestration_is_json(case):
    sent = []
    hooks = OrchestrationHooks(report_fault=lambda r: sent.append(("fault", json.dumps(r, allow_nan=False))),
                               report_recovery=lambda d: sent.append(("recovery", json.dumps(d, allow_nan=False))))
    reports = dispatch_replay_faults(RESULTS[case], hooks, topology="topo-1",
                                     step_source=lambda mode: (6, "memory"))
    assert [kind for kind, _ in sent] == ["recovery"] + ["fault"] * len(reports) and reports
    decision = json.loads(sent[0][1])
    expected_mode = "latest" if case == "straggler" else "recovery_verified"
    assert (decision["mode"], decision["step"], decision["source"], decision["topology"]) == (
        expected_mode, 6, "memory", "topo-1")
    assert set(decision) == {"failure", "mode", "source", "step", "durable_checkpoint_id", "topology", "available",
                             "reason", "ranks"}
    for (_, text), report in zip(sent[1:], reports):
        assert json.loads(text) == report == _wire(report)
        assert isinstance(report, dict) and isinstance(report, SCOUTFaultReport)


def test_a_report_reads_as_its_document_and_as_typed_attributes():
    (report,) = replay_fault_reports(RESULTS["sdc"])
    assert report["ranks"] == [1] and report.ranks == (1,)
    assert report["hosts"] == ["h1"] and report.hosts == ("h1",)
    assert report["kind"] == report.kind == "sdc" and report["step"] == report.step == 8
    assert report["evidence"]["split"] == {"aa": [0, 2], "bb": [1]}
    assert report.to_json() == dict(report) and report.to_json() is not report
    (straggler,) = replay_fault_reports(RESULTS["straggler"])
    # Tuples are JSON lists; an infinite slowdown is written as its name, strict JSON has no inf.
    assert straggler["evidence"]["groups"] == [[0, 2], [1, 2]] and straggler["evidence"]["slowdown"] == "inf"


def test_payloads_are_read_only_and_survive_pickle_and_copy():
    (report,) = replay_fault_reports(RESULTS["sdc"])
    for change in (lambda: report.__setitem__("ranks", [0]), lambda: report.update(ranks=[0]),
                   lambda: report.pop("ranks"), lambda: report.clear(), lambda: report.setdefault("x", 1)):
        with pytest.raises(TypeError, match=r"^SCOUTFaultReport is read-only"):
            change()
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'ranks'"):
        report.ranks = (0,)
    with pytest.raises(AttributeError, match=r"SCOUTFaultReport has no field 'rank'; fields: kind, scope, ranks"):
        report.rank
    assert report["ranks"] == [1]
    for twin in (pickle.loads(pickle.dumps(report)), copy.copy(report), copy.deepcopy(report)):
        assert type(twin) is SCOUTFaultReport and twin == report and twin.ranks == (1,)


def test_a_report_from_its_document_is_the_same_report():
    (report,) = replay_fault_reports(RESULTS["sdc"])
    assert SCOUTFaultReport(**_wire(report)) == report


def test_evidence_that_is_not_json_is_refused_naming_the_field():
    with pytest.raises(TypeError, match=r"^SCOUTFaultReport.evidence.tensor: Tensor .* is not a JSON value"):
        SCOUTFaultReport(kind="sdc", scope="rank", ranks=(0,), evidence={"tensor": torch.ones(2)})
    with pytest.raises(TypeError, match=r"^SCOUTFaultReport.evidence: key 3 is a int; JSON object keys are strings"):
        SCOUTFaultReport(kind="sdc", scope="rank", ranks=(0,), evidence={3: "x"})
    scalar = SCOUTFaultReport(kind="sdc", scope="rank", ranks=(0,), evidence={"loss": torch.tensor(2.5)})
    assert scalar["evidence"] == {"loss": 2.5}


def test_a_decision_is_json_and_its_mode_is_a_recovery_mode():
    decision = RecoveryDecision(failure="hang", mode=RecoveryMode.RECOVERY_VERIFIED, source="node_local", step=6,
                                durable_checkpoint_id=None, topology="t", available=True, reason="why", ranks=(2,))
    assert _wire(decision) == decision == {
        "failure": "hang", "mode": "recovery_verified", "source": "node_local", "step": 6,
        "durable_checkpoint_id": None, "topology": "t", "available": True, "reason": "why", "ranks": [2]}
    assert decision["step"] == decision.step == 6 and decision.ranks == (2,)
    assert decision.recovery_mode is RecoveryMode.RECOVERY_VERIFIED
    with pytest.raises(ValueError, match="'sometimes' is not a valid RecoveryMode"):
        RecoveryDecision(failure="hang", mode="sometimes", source=None, step=None, durable_checkpoint_id=None,
                         topology=None, available=False, reason="")


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_prepare_recovery_returns_the_mode_a_relaunch_passes_as_recovery_mode(tmp_path):
    sent = []
    config = InMemoryCkptConfig(disk_folder=str(tmp_path), run_id="relaunch", disk_flush_interval=1)
    model, optimizer = _objects()
    session = enable_resiliency(model, optimizer, interval=1, checkpoint=config, enable_detection=False,
                                orchestration=OrchestrationHooks(report_recovery=lambda d: sent.append(_wire(d))))
    for _ in range(2):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    trained = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 4))   # the next forward completes the capture of step 2
    session.manager.maybe_wait()
    latest = session.prepare_recovery("straggler", all_ranks_accessible=True)
    verified = session.prepare_recovery("hang", all_ranks_accessible=False)
    assert latest is RecoveryMode.LATEST and verified is RecoveryMode.RECOVERY_VERIFIED
    assert [(d["failure"], d["mode"], d["step"]) for d in sent] == [
        ("straggler", "latest", 2), ("hang", "recovery_verified", None)]
    assert session.last_recovery_decision == sent[-1]
    session.flush_for_restart()
    session.close()

    model, optimizer = _objects()
    relaunched = enable_resiliency(model, optimizer, interval=1, checkpoint=config, enable_detection=False,
                                   recovery_mode=latest)
    assert relaunched.step_count == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained))
    relaunched.close()
    model, optimizer = _objects()
    with pytest.raises(RecoveryUnavailable, match="recovery needs a RECOVERY_VERIFIED checkpoint"):
        enable_resiliency(model, optimizer, interval=1, checkpoint=config, enable_detection=False,
                          recovery_mode=verified)
