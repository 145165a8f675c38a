"""Configuration drift: what a fingerprint holds, which fields and ranks find_drift names, the report."""

import copy
import importlib.metadata
import json
import platform

import pytest
import torch

from lm_resiliency.manager_api import find_drift, format_drift, local_fingerprint


@pytest.fixture
def restore_torch_flags():
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    precision = torch.get_float32_matmul_precision()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    torch.set_float32_matmul_precision(precision)


def test_fingerprint_is_json_and_reports_versions_of_what_is_installed():
    fingerprint = local_fingerprint()

    assert json.loads(json.dumps(fingerprint, allow_nan=False)) == fingerprint
    assert fingerprint["python"]["version"] == platform.python_version()
    assert fingerprint["torch"]["version"] == torch.__version__
    for name in ("lm-resiliency", "lightning", "accelerate", "deepspeed"):
        assert fingerprint["packages"][name] == importlib.metadata.version(name)
    for name in ("megatron-core", "torchtitan"):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        assert fingerprint["packages"].get(name) == installed
    if torch.version.cuda is None:
        assert "cuda" not in fingerprint["torch"]
        assert fingerprint["devices"] == {"cuda_count": 0}
    else:
        assert fingerprint["torch"]["cuda"] == torch.version.cuda


def test_fingerprint_follows_the_torch_numerics_switches(restore_torch_flags):
    before = local_fingerprint()["determinism"]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.set_float32_matmul_precision("medium")
    after = local_fingerprint()["determinism"]

    assert {name for name in after if after[name] != before[name]} >= {
        "deterministic_algorithms", "cudnn.benchmark", "float32_matmul_precision"}
    assert after["deterministic_algorithms"] is True
    assert after["float32_matmul_precision"] == "medium"


def test_fingerprint_reports_allow_listed_environment_only(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("NCCL_IB_AUTH_TOKEN", "hunter2")  # prefix match, but looks like a credential
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("MY_PIPELINE_MODE", "fast")
    monkeypatch.setenv("MYAPP_SHARDS", "8")

    env = local_fingerprint()["env"]
    assert env["NCCL_ALGO"] == "Tree"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "hunter2" not in json.dumps(env)
    assert "MY_PIPELINE_MODE" not in env

    env = local_fingerprint(env_names=["MY_PIPELINE_MODE"], env_prefixes=["MYAPP_"])["env"]
    assert env["MY_PIPELINE_MODE"] == "fast"
    assert env["MYAPP_SHARDS"] == "8"
    assert list(env) == sorted(env)


def test_fingerprint_caller_fields_and_optimizer_hyperparameters():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    fingerprint = local_fingerprint(extra={"data_seed": 7, "recipe": ["a", "b"]}, optimizer=optimizer)

    assert fingerprint["extra"] == {"data_seed": 7, "recipe": ["a", "b"]}
    group = fingerprint["optimizer"]["param_groups"]["0"]
    assert fingerprint["optimizer"]["class"] == "AdamW"
    assert group["lr"] == 1e-3 and group["betas"] == [0.9, 0.999]
    assert "params" not in group
    assert json.loads(json.dumps(fingerprint)) == fingerprint


def test_fingerprint_refuses_caller_fields_that_are_not_json():
    with pytest.raises(TypeError, match=r"local_fingerprint\(extra=...\): must hold only JSON values"):
        local_fingerprint(extra={"when": object()})
    with pytest.raises(TypeError, match="must hold only JSON values.*NaN"):
        local_fingerprint(extra={"loss": float("nan")})
    with pytest.raises(TypeError, match="must be a mapping"):
        local_fingerprint(extra=["seed"])
    with pytest.raises(TypeError, match="expected a torch optimizer"):
        local_fingerprint(optimizer=object())


def test_identical_fingerprints_have_no_drift():
    fingerprint = local_fingerprint()
    assert find_drift({rank: copy.deepcopy(fingerprint) for rank in range(4)}) == {}
    assert find_drift([fingerprint]) == {}
    assert find_drift({}) == {}
    assert format_drift({}) == "no configuration drift"


def test_changed_hyperparameter_on_one_rank_is_named_with_majority_and_minority():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    clean = local_fingerprint(optimizer=optimizer)
    optimizer.param_groups[0]["lr"] = 0.2
    drifted = local_fingerprint(optimizer=optimizer)

    drift = find_drift({0: clean, 1: clean, 2: drifted, 3: clean})
    assert drift == {"optimizer.param_groups.0.lr": {
        "values": [{"value": 0.1, "ranks": [0, 1, 3]}, {"value": 0.2, "ranks": [2]}],
        "majority": {"value": 0.1, "ranks": [0, 1, 3]},
        "minority_ranks": [2],
    }}
    assert json.loads(json.dumps(drift)) == drift
    assert format_drift(drift) == "optimizer.param_groups.0.lr: 0.1 on ranks 0-1, 3 (majority); 0.2 on rank 2"


def _with(fingerprint, section, field, value):
    changed = copy.deepcopy(fingerprint)
    changed[section][field] = value
    return changed


def test_a_field_set_on_some_ranks_only_is_drift_and_ranks_are_sorted():
    base = local_fingerprint()
    tree = _with(base, "env", "NCCL_ALGO", "Tree")
    ring = _with(base, "env", "NCCL_ALGO", "Ring")
    # Keys as a JSON round trip leaves them (strings), in no particular order.
    drift = find_drift({"5": ring, "0": ring, "3": tree, "1": base, "2": ring, "4": base})

    assert drift == {"env.NCCL_ALGO": {
        "values": [{"value": "Ring", "ranks": [0, 2, 5]},
                   {"missing": True, "ranks": [1, 4]},
                   {"value": "Tree", "ranks": [3]}],
        "majority": {"value": "Ring", "ranks": [0, 2, 5]},
        "minority_ranks": [1, 3, 4],
    }}
    assert format_drift(drift) == ('env.NCCL_ALGO: "Ring" on ranks 0, 2, 5 (majority); '
                                   'unset on ranks 1, 4; "Tree" on rank 3')


def test_a_tie_has_no_majority_and_names_every_rank():
    base = local_fingerprint()
    drift = find_drift([_with(base, "determinism", "cudnn.benchmark", False),
                        _with(base, "determinism", "cudnn.benchmark", True)])

    assert drift["determinism.cudnn.benchmark"]["majority"] is None
    assert drift["determinism.cudnn.benchmark"]["minority_ranks"] == [0, 1]
    assert format_drift(drift) == ("determinism.cudnn.benchmark: false on rank 0; true on rank 1 "
                                   "(no majority)")


def test_several_fields_come_back_in_name_order_and_ignore_drops_a_subtree():
    base = local_fingerprint()
    odd = _with(_with(base, "torch", "version", "2.0.0"), "devices", "cuda_names", ["A100"])
    drift = find_drift([base, base, odd])

    assert list(drift) == ["devices.cuda_names", "torch.version"]
    assert drift["devices.cuda_names"]["values"][0] == {"missing": True, "ranks": [0, 1]}
    assert list(find_drift([base, base, odd], ignore=["devices"])) == ["torch.version"]
    assert find_drift([base, base, odd], ignore=["devices", "torch.version"]) == {}
    assert format_drift(drift).splitlines()[1] == ('torch.version: "' + torch.__version__
                                                   + '" on ranks 0-1 (majority); "2.0.0" on rank 2')


def test_list_values_compare_whole_and_long_values_are_shortened_in_the_report():
    base = local_fingerprint(extra={"layers": list(range(40))})
    other = local_fingerprint(extra={"layers": list(range(39)) + [0]})
    drift = find_drift([base, other, base])

    assert list(drift) == ["extra.layers"]
    line = format_drift(drift)
    assert line.startswith("extra.layers: [0, 1, 2,") and "... on ranks 0, 2 (majority)" in line
    assert len(line) < 220


def test_find_drift_rejects_malformed_input():
    fingerprint = local_fingerprint()
    with pytest.raises(ValueError, match="rank keys must be non-negative ints or decimal strings, got 'r0'"):
        find_drift({"r0": fingerprint})
    with pytest.raises(ValueError, match="rank 1 appears twice"):
        find_drift({1: fingerprint, "1": fingerprint})
    with pytest.raises(TypeError, match="the fingerprint of rank 1 must be a dict"):
        find_drift([fingerprint, "torch 2.13"])
    with pytest.raises(TypeError, match="expected a dict rank -> fingerprint or a list"):
        find_drift("fingerprints")
    with pytest.raises(TypeError, match="fingerprint of rank 0, field 'extra.when'.*JSON"):
        find_drift([{"extra": {"when": object()}}])
