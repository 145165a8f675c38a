"""enable_fault_injection: hooks only, the optimizer boundary drives the clock, faults really happen
on the target rank, lifetimes/triggers/retriggers behave, and the journal holds the ground truth."""

import errno
import json
import os
import time

import pytest
import torch

from lm_resiliency.faults import (CallbackFaultExecutor, CampaignJournal, ClockOrigin, ClockSpec, ClockType,
                                  CorruptionOperation, FailureType, FaultCampaign, FaultExecutionResult,
                                  FaultIncident, FaultScope, FaultSpec, FaultSurface, FaultTarget,
                                  IncidentLifetime, IncidentTrigger, InjectedFault, InjectedIOError,
                                  InjectedTimeout, InjectionStatus, IterationRange, JsonCampaignStateStore,
                                  LocalFaultExecutor, LocalizationResult, MemoryCampaignStateStore,
                                  RetriggerPolicy, UnsupportedFaultError, enable_fault_injection)
from lm_resiliency.faults.schedule import probability_draw

from .test_schema import guide_campaign
from .workloads import batches, flat_params, make_model, sdc_campaign, train

FLIP = {"operation": CorruptionOperation.SIGN_FLIP.value, "scope": FaultScope.FULL.value}


def one(fault_type, surface=FaultSurface.OUTPUT, params=None, *, at=(3,), lifetime=None, rank=0,
        module_path="layers.1", retrigger=RetriggerPolicy.ONCE, trigger=None, seed=0, clock=None):
    if surface not in (FaultSurface.OUTPUT, FaultSurface.INPUT, FaultSurface.PARAMETER, FaultSurface.GRADIENT,
                       FaultSurface.OPTIMIZER_STATE):
        module_path = None
    spec = FaultSpec(fault_id="f", type=fault_type, target=FaultTarget(rank=rank, module_path=module_path,
                                                                        surface=surface),
                     parameters=params if params is not None else {})
    incident = FaultIncident(incident_id="i", trigger=trigger or IncidentTrigger(at=at),
                             lifetime=lifetime or IncidentLifetime(), retrigger=retrigger, faults=(spec,))
    return FaultCampaign(name="t", incidents=(incident,), seed=seed, clock=clock or ClockSpec())


def capture(model, module_name="layers.1"):
    """Per forward call: (iteration index by call order, output copy)."""
    seen = []
    model.get_submodule(module_name).register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    return seen


def reference_outputs(n, forwards_per_step=1, module_name="layers.1"):
    model, opt = make_model()
    seen = capture(model, module_name)
    train(model, opt, batches(n), forwards_per_step)
    return seen, flat_params(model)


def corrupted_calls(seen, ref):
    return [i for i, (a, b) in enumerate(zip(seen, ref)) if not torch.equal(a, b)]


def first_corrupted(seen, ref):
    """Index of the first forward call whose output differs (later ones differ as a consequence)."""
    calls = corrupted_calls(seen, ref)
    return calls[0] if calls else None


# ------------------------------------------------------------------ guide example, target rank only

def test_guide_example_runs_unchanged_loop_and_corrupts_iteration_20():
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=guide_campaign())
    seen = capture(model, "layers.2")
    train(model, optimizer, batches(22))
    ref, ref_params = reference_outputs(22, module_name="layers.2")
    assert first_corrupted(seen, ref) == 19  # the 20th iteration's forward
    assert torch.equal(seen[19], -ref[19]) and torch.equal(seen[18], ref[18])
    [record] = faults.records
    assert (record.occurrence_id, record.status, record.iteration, record.call_index, record.rank) == (
        "hidden-sdc@20", InjectionStatus.INJECTED, 20, 1, 0)
    assert record.evidence["elements_changed"] == seen[19].numel()
    assert faults.iteration == 23
    report = faults.evaluate([LocalizationResult(ranks=(0,), kind="sdc", iteration=20)])
    assert report.recall == 1.0 and report.evaluations[0].localized_exactly
    faults.close()


@pytest.mark.parametrize("rank, expect_corrupted", [(0, True), (1, False)])
def test_corruption_happens_on_target_rank_only(rank, expect_corrupted):
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(rank=0, at=3), rank=rank,
                                    world_size=2)
    seen = capture(model)
    train(model, optimizer, batches(5))
    ref, ref_params = reference_outputs(5)
    assert first_corrupted(seen, ref) == (2 if expect_corrupted else None)
    if expect_corrupted:
        assert torch.equal(seen[2], -ref[2])
    assert torch.equal(flat_params(model), ref_params) is (not expect_corrupted)
    assert [r.status for r in faults.records] == ([InjectionStatus.INJECTED] if expect_corrupted else [])
    faults.close()


def test_close_removes_every_hook():
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(rank=0, at=1))
    faults.close()
    faults.close()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not model.layers[1]._forward_hooks
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    seen = capture(model)
    train(model, optimizer, batches(2))
    assert corrupted_calls(seen, reference_outputs(2)[0]) == []


def test_ddp_style_wrapper_path_and_bad_path():
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    inner, optimizer = make_model()
    model = Wrapper(inner)
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(rank=0, at=2))
    seen = capture(inner)
    train(model, optimizer, batches(3))
    assert first_corrupted(seen, reference_outputs(3)[0]) == 1
    faults.close()
    bad = one(FailureType.TENSOR_CORRUPTION, params=FLIP, module_path="layers.9")
    with pytest.raises(ValueError, match="no submodule 'layers.9'"):
        enable_fault_injection(inner, optimizer, campaign=bad)


# ------------------------------------------------------------------ lifetimes and triggers

def _injected(faults):
    return [(r.occurrence_id, r.iteration, r.call_index) for r in faults.records
            if r.status is InjectionStatus.INJECTED]


def test_matching_calls_lifetime_spans_forward_calls():
    model, optimizer = make_model()
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP, at=(4,), lifetime=IncidentLifetime(matching_calls=3))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    seen = capture(model)
    train(model, optimizer, batches(6), forwards_per_step=2)
    ref, _ = reference_outputs(6, forwards_per_step=2)
    # Iteration 4 is calls 6 and 7; the third matching call is iteration 5's first forward (call 8).
    assert first_corrupted(seen, ref) == 6 and torch.equal(seen[6], -ref[6])
    assert _injected(faults) == [("i@4", 4, 1), ("i@4", 4, 2), ("i@4", 5, 3)]


def test_iterations_lifetime_and_permanent():
    model, optimizer = make_model()
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP, at=(3,), lifetime=IncidentLifetime(iterations=2))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    train(model, optimizer, batches(6), forwards_per_step=2)
    assert [(it, c) for _, it, c in _injected(faults)] == [(3, 1), (3, 2), (4, 3), (4, 4)]
    faults.close()

    model, optimizer = make_model()
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP, at=(5,), lifetime=IncidentLifetime(permanent=True))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    train(model, optimizer, batches(9))
    assert [it for _, it, _ in _injected(faults)] == [5, 6, 7, 8, 9]
    assert faults.active_occurrences == ("i@5",)


def test_range_trigger_makes_one_occurrence_per_tick():
    model, optimizer = make_model()
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP,
                   trigger=IncidentTrigger(range=IterationRange(2, 10, every=3)))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    train(model, optimizer, batches(12))
    assert _injected(faults) == [("i@2", 2, 1), ("i@5", 5, 1), ("i@8", 8, 1)]


def _probability_run(seed):
    model, optimizer = make_model()
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP, seed=seed,
                   trigger=IncidentTrigger(range=IterationRange(1, 41), probability=0.3))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    train(model, optimizer, batches(40))
    return [occ for occ, _, _ in _injected(faults)]


def test_probability_trigger_is_reproducible_from_the_seed():
    first, again, other = _probability_run(42), _probability_run(42), _probability_run(43)
    expected = [f"i@{t}" for t in range(1, 41) if probability_draw(42, "i", t) < 0.3]
    assert first == again == expected
    assert 0 < len(first) < 40 and other != first


def test_expired_when_module_is_never_called():
    model, optimizer = make_model()
    model.spare = torch.nn.Linear(4, 4)  # never called in forward
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP, module_path="spare", at=(2,),
                   lifetime=IncidentLifetime(iterations=1))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    train(model, optimizer, batches(3))
    assert [(r.status, r.iteration) for r in faults.records] == [(InjectionStatus.EXPIRED, 3)]


# ------------------------------------------------------------------ restarts and occurrence ids

def test_restart_stable_occurrence_is_not_injected_twice(tmp_path):
    store = JsonCampaignStateStore(str(tmp_path / "state.json"))
    journal = CampaignJournal(str(tmp_path / "journal.jsonl"))
    data = batches(6)
    model, optimizer = make_model()
    first = enable_fault_injection(model, optimizer, campaign=sdc_campaign(0, at=4), state_store=store,
                                   journal=journal, generation="0")
    train(model, optimizer, data)
    first.close()
    # A replacement worker recovers the state of step 2 and replays iterations 3..6, including 4.
    model, optimizer = make_model()
    train(model, optimizer, data[:2])
    second = enable_fault_injection(model, optimizer, campaign=sdc_campaign(0, at=4), state_store=store,
                                    journal=journal, generation="1", start_iteration=2)
    seen = capture(model)
    assert second.iteration == 3
    train(model, optimizer, data[2:])
    assert [(r.occurrence_id, r.status, r.generation) for r in journal.records()] == [
        ("sdc@4", InjectionStatus.INJECTED, "0"), ("sdc@4", InjectionStatus.ALREADY_CLAIMED, "1")]
    assert list(store.claims()) == ["sdc@4/rank-0"]
    ref_model, ref_opt = make_model()
    ref_seen = capture(ref_model)
    train(ref_model, ref_opt, data[:2])
    ref_seen.clear()
    train(ref_model, ref_opt, data[2:])
    assert corrupted_calls(seen, ref_seen) == []


def test_every_generation_policy_and_resume_step_from_environment(tmp_path, monkeypatch):
    store = MemoryCampaignStateStore()
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP, at=(4,), retrigger=RetriggerPolicy.EVERY_GENERATION)
    for generation in ("0", "1"):
        monkeypatch.setenv("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "2" if generation == "1" else "0")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", generation)
        model, optimizer = make_model()
        faults = enable_fault_injection(model, optimizer, campaign=campaign, state_store=store)
        assert faults.iteration == (3 if generation == "1" else 1)
        train(model, optimizer, batches(4))
        assert _injected(faults) == [("i@4", 4, 1)]
        faults.close()
    assert sorted(store.claims()) == ["i@4/rank-0/generation-0", "i@4/rank-0/generation-1"]


def test_generation_start_origin_counts_from_attach():
    model, optimizer = make_model()
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP, at=(2,),
                   clock=ClockSpec(ClockType.TRAINING_ITERATION, ClockOrigin.GENERATION_START))
    faults = enable_fault_injection(model, optimizer, campaign=campaign, start_iteration=10)
    train(model, optimizer, batches(3))
    assert _injected(faults) == [("i@2", 12, 1)]


def test_wall_clock_tick_zero_fires_at_attach():
    model, optimizer = make_model()
    campaign = one(FailureType.TENSOR_CORRUPTION, params=FLIP, at=(0,),
                   clock=ClockSpec(ClockType.WALL_CLOCK, ClockOrigin.RUN_START))
    store = MemoryCampaignStateStore()
    faults = enable_fault_injection(model, optimizer, campaign=campaign, state_store=store)
    train(model, optimizer, batches(2))
    assert _injected(faults) == [("i@0", 1, 1)]
    assert "wall_clock_origin" in store.load()["values"]


def test_set_iteration_after_in_process_recovery():
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(0, at=3))
    train(model, optimizer, batches(4))
    faults.set_iteration(1)  # recovered to step 1: iterations 2.. replay; i@3 is already claimed
    train(model, optimizer, batches(3))
    assert [(r.status, r.iteration) for r in faults.records] == [
        (InjectionStatus.INJECTED, 3), (InjectionStatus.ALREADY_CLAIMED, 3)]


# ------------------------------------------------------------------ other surfaces and types

def test_parameter_gradient_and_optimizer_state_corruption():
    model, optimizer = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    spec = lambda fid, surface, params: FaultSpec(fault_id=fid, type=FailureType.TENSOR_CORRUPTION,  # noqa: E731
                                                  target=FaultTarget(0, "layers.0", surface), parameters=params)
    campaign = FaultCampaign("t", (
        FaultIncident("p", IncidentTrigger(at=(2,)), (spec("param", FaultSurface.PARAMETER,
                                                           {"operation": "zero", "parameter": "bias"}),)),
        FaultIncident("g", IncidentTrigger(at=(3,)), (spec("grad", FaultSurface.GRADIENT,
                                                           {"operation": "nan", "parameter": "weight"}),)),
        FaultIncident("o", IncidentTrigger(at=(4,)), (spec("opt", FaultSurface.OPTIMIZER_STATE,
                                                           {"operation": "scale", "factor": 0.0,
                                                            "state_key": "momentum_buffer"}),)),
    ))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    bias_seen = []
    model.register_forward_pre_hook(lambda m, a: bias_seen.append(model.layers[0].bias.detach().clone()),
                                    prepend=False)
    data = batches(4)
    train(model, optimizer, data[:1])
    train(model, optimizer, data[1:2])
    assert torch.all(bias_seen[1] == 0)  # zeroed at the start of iteration 2, before its forward
    train(model, optimizer, data[2:3])
    assert torch.isnan(model.layers[0].weight).all()  # NaN gradient applied by step 3
    train(model, optimizer, data[3:4])
    records = {r.fault_id: r for r in faults.records if r.injected}
    assert records["param"].evidence["elements_changed"] == 4 and records["param"].iteration == 2
    assert records["grad"].evidence["elements_changed"] == 16 and records["grad"].iteration == 3
    assert records["opt"].status is InjectionStatus.INJECTED and records["opt"].iteration == 4


def test_stale_state_undoes_one_update():
    model, optimizer = make_model()
    campaign = one(FailureType.STALE_STATE, FaultSurface.PARAMETER, {"parameter": "weight"}, at=(2,),
                   module_path="layers.3")
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    data = batches(2)
    train(model, optimizer, data[:1])
    before = model.layers[3].weight.detach().clone()
    train(model, optimizer, data[1:])
    assert torch.equal(model.layers[3].weight, before)  # iteration 2's update was lost
    [record] = faults.records
    assert record.status is InjectionStatus.INJECTED and record.evidence["elements_reverted"] > 0


def test_delay_hang_and_exceptions():
    slept = []
    executor = LocalFaultExecutor(sleep=slept.append)
    model, optimizer = make_model()
    campaign = FaultCampaign("t", (
        FaultIncident("slow", IncidentTrigger(at=(1,)), (FaultSpec("d", "delay", FaultTarget(0, "layers.2", "output"),
                                                                   {"seconds": 0.5}),),
                      lifetime=IncidentLifetime(iterations=2)),
        FaultIncident("stuck", IncidentTrigger(at=(2,)), (FaultSpec("h", "hang", FaultTarget(0), {"seconds": 30}),)),
    ))
    faults = enable_fault_injection(model, optimizer, campaign=campaign, executor=executor)
    train(model, optimizer, batches(3))
    assert slept == [0.5, 30, 0.5]  # iteration 1 delay; iteration 2 hang at its start, then delay
    assert [r.fault_id for r in faults.records] == ["d", "h", "d"]
    faults.close()

    model, optimizer = make_model()
    real = enable_fault_injection(model, optimizer, campaign=one(FailureType.HANG, FaultSurface.PROCESS,
                                                                 {"seconds": 0.05}, at=(1,)))
    started = time.monotonic()
    train(model, optimizer, batches(1))
    assert time.monotonic() - started >= 0.05
    # A hang is journaled before it blocks: a supervisor that kills the hung rank keeps the truth.
    assert real.records[0].evidence == {"seconds": 0.05, "phase": real.records[0].evidence["phase"],
                                        "journaled": "before blocking"}

    for fault_type, params, exc_type in ((FailureType.EXCEPTION, {"message": "boom"}, InjectedFault),
                                         (FailureType.TIMEOUT, {"seconds": 0.0}, InjectedTimeout),
                                         (FailureType.IO_ERROR, {"errno": errno.ENOSPC}, InjectedIOError)):
        model, optimizer = make_model()
        faults = enable_fault_injection(model, optimizer, campaign=one(fault_type, FaultSurface.PROCESS, params))
        train(model, optimizer, batches(2))
        with pytest.raises(exc_type) as info:
            train(model, optimizer, batches(1))
        assert info.value.occurrence_id == "i@3"
        [record] = faults.records
        assert record.status is InjectionStatus.INJECTED and record.iteration == 3
        if fault_type is FailureType.IO_ERROR:
            assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)


def test_dataloader_drop_duplicate_reorder():
    def run(fault_type):
        model, optimizer = make_model()
        faults = enable_fault_injection(model, optimizer, campaign=one(fault_type, FaultSurface.DATALOADER, at=(2,)))
        out = []
        for batch in faults.wrap_dataloader(range(5)):
            out.append(batch)
            model(torch.zeros(1, 4)).sum().backward()
            optimizer.step()
        return out, faults.records

    assert run(FailureType.DROP)[0] == [0, 2, 3, 4]
    assert run(FailureType.DUPLICATE)[0] == [0, 1, 1, 2, 3, 4]
    out, records = run(FailureType.REORDER)
    assert out == [0, 2, 1, 3, 4] and records[0].evidence["action"] == "reorder"


def test_config_drift_of_optimizer_and_environment(monkeypatch):
    monkeypatch.delenv("LMR_TEST_DRIFT", raising=False)
    model, optimizer = make_model()
    campaign = FaultCampaign("t", (FaultIncident("c", IncidentTrigger(at=(2,)), (
        FaultSpec("lr", "config_drift", FaultTarget(0, surface="config"), {"key": "lr", "value": 0.5}),
        FaultSpec("env", "config_drift", FaultTarget(0, surface="config"), {"env": "LMR_TEST_DRIFT", "value": 7}),
    )),))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    seen = []
    model.register_forward_hook(lambda *_: seen.append((optimizer.param_groups[0]["lr"],
                                                         os.environ.get("LMR_TEST_DRIFT"))))
    train(model, optimizer, batches(3))
    # In effect during its window (iteration 2), set back when the window ends.
    assert seen == [(0.05, None), (0.5, "7"), (0.05, None)]
    lr = next(r for r in faults.records if r.fault_id == "lr")
    assert lr.to_json()["evidence"]["groups"] == [{"param_group": 0, "before": 0.05, "after": 0.5}]
    assert [(r.fault_id, r.status.value) for r in faults.records] == [
        ("lr", "injected"), ("env", "injected"), ("lr", "deactivated"), ("env", "deactivated")]


def test_resource_exhaustion_stays_in_the_sandbox(tmp_path):
    model, optimizer = make_model()
    campaign = one(FailureType.RESOURCE_EXHAUSTION, FaultSurface.STORAGE, {"resource": "disk", "bytes": 3000},
                   at=(1,))
    faults = enable_fault_injection(model, optimizer, campaign=campaign, sandbox_dir=str(tmp_path / "sb"))
    sizes = []
    model.register_forward_hook(lambda *_: sizes.append(sorted(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(tmp_path / "sb") for f in files)))
    train(model, optimizer, batches(2))
    injected, released = faults.records
    path = injected.evidence["path"]
    assert path.startswith(str(tmp_path / "sb" / "rank-0")) and sizes == [[3000], []]
    # The disk is full during the fault's window (iteration 1) and released when it ends.
    assert released.status is InjectionStatus.DEACTIVATED and released.evidence["removed_files"] == (path,)
    faults.close()
    assert os.path.isdir(os.path.dirname(path))  # a caller-provided sandbox is left to the caller

    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=campaign)  # session-owned sandbox
    train(model, optimizer, batches(1))
    path = faults.records[0].evidence["path"]
    faults.close()
    assert not os.path.exists(os.path.dirname(path))


def test_unsupported_faults_fail_at_attach_or_are_recorded():
    model, optimizer = make_model()
    partition = one(FailureType.NETWORK_PARTITION, FaultSurface.NETWORK, at=(1,))
    with pytest.raises(UnsupportedFaultError, match="network"):
        enable_fault_injection(model, optimizer, campaign=partition)
    gpu = one(FailureType.RESOURCE_EXHAUSTION, FaultSurface.DEVICE, {"resource": "device_memory"}, at=(1,))
    with pytest.raises(UnsupportedFaultError, match="accelerator memory"):
        enable_fault_injection(model, optimizer, campaign=gpu)
    kill = one(FailureType.PROCESS_TERMINATION, FaultSurface.PROCESS, at=(1,))
    with pytest.raises(UnsupportedFaultError, match="allow_process_termination"):
        enable_fault_injection(model, optimizer, campaign=kill)
    assert not model._forward_pre_hooks  # nothing left attached after a failed attach

    faults = enable_fault_injection(model, optimizer, campaign=partition, strict=False)
    train(model, optimizer, batches(2))
    [record] = faults.records
    assert record.status is InjectionStatus.UNSUPPORTED and "network" in record.detail
    faults.close()

    desync = one(FailureType.COLLECTIVE_DESYNC, FaultSurface.COLLECTIVE, at=(1,))
    faults = enable_fault_injection(model, optimizer, campaign=desync, strict=False)
    train(model, optimizer, batches(2))
    assert faults.records[0].status is InjectionStatus.UNSUPPORTED
    assert faults.evaluate().injected == 0


def test_callback_executor_plugs_custom_effects():
    seen = []

    def fn(request):
        seen.append((request.occurrence_id, request.phase, request.rank, request.iteration, request.call_index,
                     dict(request.parameters)))
        return FaultExecutionResult(evidence={"custom": True}) if request.call_index == 1 else None

    executor = CallbackFaultExecutor(fn, failure_types=[FailureType.MESSAGE_DROP], fallback=LocalFaultExecutor())
    model, optimizer = make_model()
    campaign = FaultCampaign("t", (
        FaultIncident("m", IncidentTrigger(at=(2,)), (FaultSpec("drop-msg", "message_drop",
                                                                FaultTarget(0, surface="network"),
                                                                {"peer": 1, "x_port": 29500}),),
                      lifetime=IncidentLifetime(matching_calls=2)),
        FaultIncident("s", IncidentTrigger(at=(2,)), (FaultSpec("flip", "tensor_corruption",
                                                                FaultTarget(0, "layers.1", "output"), FLIP),)),
    ))
    faults = enable_fault_injection(model, optimizer, campaign=campaign, executor=executor)
    train(model, optimizer, batches(4))
    assert seen == [("m@2", "iteration_start", 0, 2, 1, {"peer": 1, "x_port": 29500}),
                    ("m@2", "iteration_start", 0, 3, 2, {"peer": 1, "x_port": 29500})]
    assert [(r.fault_id, r.status.value, dict(r.evidence).get("custom")) for r in faults.records] == [
        ("drop-msg", "injected", True), ("flip", "injected", None), ("drop-msg", "injected", None)]
    with pytest.raises(UnsupportedFaultError, match="no fallback"):
        enable_fault_injection(model, optimizer, campaign=sdc_campaign(0),
                               executor=CallbackFaultExecutor(fn, failure_types=[FailureType.DROP]))


def test_journal_file_is_json_lines(tmp_path):
    path = tmp_path / "j" / "journal.jsonl"
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(0, at=1),
                                    journal=CampaignJournal(str(path)))
    train(model, optimizer, batches(2))
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["occurrence_id"] == "sdc@1"
    with open(path, "ab") as f:
        f.write(b'{"torn')  # a writer killed mid-line
    assert CampaignJournal(str(path)).records() == faults.records
    path.write_text("not json\n" + lines[0] + "\n")
    with pytest.raises(ValueError, match=r"journal.jsonl:1: malformed journal line"):
        CampaignJournal(str(path)).records()
