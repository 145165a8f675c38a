"""MoE workload pieces in one process: materializers, catalogs, AllToAll policy, the discovery CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from lm_resiliency import (
    AllToAllCapture,
    AllToAllTrafficMatrix,
    BalancedAndPermutationPolicy,
    GroupedExpertMaterializer,
    LeadingDimensionMaterializer,
    ReplayHarnessConfig,
    ReplayWorkload,
)
from lm_resiliency._values import ConfigError

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "moe_regimes")


def test_grouped_materializer_sets_counts_and_resizes_token_aligned_inputs():
    tokens = torch.arange(10.0).reshape(5, 2)
    counts = torch.tensor([2, 3])
    probs = torch.arange(5.0)
    (t, c, p), kwargs = GroupedExpertMaterializer(alignment=4).materialize((tokens, counts, probs), {}, 3)
    assert c.tolist() == [4, 4] and c.dtype == counts.dtype
    assert t.shape == (8, 2) and torch.equal(t, tokens[torch.arange(8) % 5])
    assert torch.equal(p, probs[torch.arange(8) % 5]) and kwargs == {}
    (_, c2, _), _ = GroupedExpertMaterializer().materialize((tokens, counts, probs), {}, (1, 6))
    assert c2.tolist() == [1, 6]


def test_grouped_materializer_errors_name_the_input():
    with pytest.raises(ValueError, match="tokens_per_expert sums to 4 but tokens has 5 rows"):
        GroupedExpertMaterializer().materialize((torch.zeros(5, 2), torch.tensor([2, 2])), {}, 3)
    with pytest.raises(ValueError, match="keyword input 'counts'"):
        GroupedExpertMaterializer(counts_input="counts").materialize((torch.zeros(5, 2),), {}, 3)


def test_leading_dimension_materializer():
    (x, mask), _ = LeadingDimensionMaterializer().materialize((torch.arange(3.0), torch.ones(3, 1)), {}, 5)
    assert x.tolist() == [0.0, 1.0, 2.0, 0.0, 1.0] and mask.shape == (5, 1)
    with pytest.raises(ValueError, match="scalar recipes"):
        LeadingDimensionMaterializer().materialize((torch.zeros(3),), {}, (1, 2))


def test_workload_catalog_validation():
    experts = nn.Linear(2, 2)
    workload = ReplayWorkload.from_moe_catalog([4, {"n_exec": 8}, {"counts": [1, 2]}], replay_modules=[experts])
    assert workload.recipes == (4, 8, (1, 2)) and workload.peer_role == "expert"
    assert isinstance(workload.materializer, GroupedExpertMaterializer)
    assert ReplayWorkload.from_shapes([3], replay_modules=[experts], peer_role="expert").peer_role == "expert"
    with pytest.raises(ValueError, match="recipes repeat"):
        ReplayWorkload.from_moe_catalog([4, 4], replay_modules=[experts])
    with pytest.raises(ValueError, match="not complete"):
        ReplayWorkload.from_moe_catalog({"schema": "lm-resiliency/moe-replay-catalog/v1", "complete": False,
                                         "recipes": [4], "problems": ["x"]}, replay_modules=[experts])
    with pytest.raises(ValueError, match="peer_role"):
        ReplayWorkload.from_shapes([3], replay_modules=[experts], peer_role="tensor")
    with pytest.raises(ConfigError, match="ReplayHarnessConfig.workload"):
        ReplayHarnessConfig(workload=[4])
    with pytest.raises(ConfigError, match="ReplayHarnessConfig.all_to_all_policy"):
        ReplayHarnessConfig(all_to_all_policy="balanced")
    assert ReplayHarnessConfig(all_to_all_policy=None).all_to_all_policy is None


def test_balanced_and_permutation_policy_respects_budget_and_one_row_minimum():
    capture = AllToAllCapture(group_ranks=(0, 1, 2, 3), op="all_to_all_single", row_shape=(256,),
                              dtype=torch.float32, sequence=1)
    balanced, permutation = BalancedAndPermutationPolicy().generate(capture)
    assert balanced.rows == ((1024,) * 4,) * 4            # 4 MiB / 1 KiB rows / 4 routes
    assert permutation.name == "permutation+2"
    assert [sum(permutation.sent_by(i)) for i in range(4)] == [4096] * 4
    assert [sum(permutation.received_by(j)) for j in range(4)] == [4096] * 4
    tiny = BalancedAndPermutationPolicy(max_payload_bytes_per_rank=1).generate(capture)
    assert tiny[0].rows == ((1,) * 4,) * 4 and sum(tiny[1].sent_by(0)) == 1
    with pytest.raises(ValueError, match="square"):
        AllToAllTrafficMatrix(((1, 2),))


def _cli(tmp_path, *files, **overrides):
    paths = []
    for name in ("observations", "environment", "request"):
        with open(os.path.join(EXAMPLE, f"{name}.json")) as f:
            doc = json.load(f)
        doc.update(overrides.get(name, {}))
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        paths += [f"--{name}", str(path)]
    out = tmp_path / "catalog.json"
    proc = subprocess.run([sys.executable, "-m", "lm_resiliency.scout.moe_regimes", *paths, "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    return proc, out


def test_cli_builds_the_sample_catalog_that_from_moe_catalog_accepts(tmp_path):
    proc, out = _cli(tmp_path)
    assert proc.returncode == 0, proc.stderr
    catalog = json.loads(out.read_text())
    assert [r["n_exec"] for r in catalog["recipes"]] == [12, 32, 72, 140]
    assert catalog["complete"] is True and catalog["exact"] is False
    workload = ReplayWorkload.from_moe_catalog(catalog, replay_modules=[nn.Linear(2, 2)])
    assert workload.recipes == (12, 32, 72, 140)


@pytest.mark.parametrize("overrides, message", [
    ({"request": {"max_recipes": 2}}, "4 observed regimes exceed max_recipes 2"),
    ({"request": {"layers": ["layers.0.moe.experts", "layers.9"]}}, "layers.1.moe.experts' is not a requested"),
    ({"environment": {"local_experts": 2}}, "4 counts, the environment has 2 local experts"),
    ({"environment": {"regime_boundaries": [1, 64, 16]}}, "environment.regime_boundaries: invalid value"),
    ({"environment": {"gpu": "h100"}}, "environment: unknown key(s) ['gpu'] in a MoE environment"),
    ({"request": {"schema": "v0"}}, "request: not a MoE regime request of this version: schema: expected"),
    ({"request": {"layers": ["layers.0.moe.experts", "layers.0.moe.experts"]}}, "request.layers: invalid value"),
])
def test_cli_rejects_bad_input_with_a_clear_error(tmp_path, overrides, message):
    proc, out = _cli(tmp_path, **overrides)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not out.exists()


def test_expert_peers_come_from_the_frameworks_own_groups():
    """Megatron's adapter publishes its expert-data-parallel groups: they win over an `ep` degree
    (which assumes Megatron's default rank order) and must partition the job."""
    from lm_resiliency.scout.moe_replay import expert_peer_groups
    from lm_resiliency.scout.peers import UnknownLayoutError

    declared = {"expert_peer_groups": [[1, 3], [0, 2]], "ep": 2}
    assert expert_peer_groups(None, declared, 4) == [[0, 2], [1, 3]]
    assert expert_peer_groups(None, {"ep": 2}, 4) == [[0, 2], [1, 3]]
    with pytest.raises(UnknownLayoutError, match="do not partition the 4 ranks"):
        expert_peer_groups(None, {"expert_peer_groups": [[0, 1], [1, 2]]}, 4)
