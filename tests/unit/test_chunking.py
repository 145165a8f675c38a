"""estimate_chunk_size: the documented formula, MiB rounding, monotonicity, validation."""

import math

import pytest

from lm_resiliency import estimate_chunk_size

MIB = 1024 * 1024


def test_guide_example_exact_value():
    # 400 Gb/s NIC, 9.4 ms layer compute, 1.0 ms all-gather, at most 5% delay.
    #   bytes per ms  = 400e9 / 8 / 1e3          = 50_000_000
    #   slack         = 9.4 - 1.0                = 8.4 ms
    #   fraction cap  = 0.05 * 9.4               = 0.47 ms
    #   budget        = min(0.47, 8.4)           = 0.47 ms
    #   raw bytes     = 50_000_000 * 0.47        = 23_500_000
    #   whole MiB     = 23_500_000 // 1_048_576  = 22   -> 22 * 1_048_576 = 23_068_672
    assert estimate_chunk_size(400, 9.4, 1.0, 0.05) == 22 * MIB == 23_068_672


@pytest.mark.parametrize("args", [
    (400, 9.4, 1.0, 0.05), (1, 1.0, 0.5, 0.01), (3.3, 7.0, 2.0, 1.0), (1600, 50.0, 49.0, 0.9),
    (100, 2.0, 0.1, 0.5),
])
def test_result_is_a_whole_positive_number_of_mib(args):
    chunk = estimate_chunk_size(*args)
    assert isinstance(chunk, int) and not isinstance(chunk, bool)
    assert chunk >= MIB and chunk % MIB == 0


def test_tiny_budget_floors_at_one_mib():
    # 1 Gb/s * 0.01 ms = 1250 bytes, far below 1 MiB.
    assert estimate_chunk_size(1, 1.0, 0.5, 0.01) == MIB


def test_monotone_in_bandwidth():
    sizes = [estimate_chunk_size(bw, 9.4, 1.0, 0.05) for bw in (10, 25, 50, 100, 200, 400, 800, 1600)]
    assert sizes == sorted(sizes)
    assert sizes[-1] > sizes[0]


def test_capped_by_slack():
    # slack = 10 - 9.9 = 0.1 ms < 0.5 * 10 = 5 ms, so the slack is the budget:
    #   50_000_000 B/ms * 0.1 ms ~= 5_000_000 B -> 4 MiB (4_194_304 <= 5_000_000 < 5_242_880)
    capped = estimate_chunk_size(400, 10.0, 9.9, 0.5)
    assert capped == 4 * MIB
    # With the same fraction and more slack the fraction cap applies instead and is larger.
    assert estimate_chunk_size(400, 10.0, 1.0, 0.5) == int(50_000_000 * 5.0) // MIB * MIB
    # Raising the allowed fraction cannot lift the result past the slack bound.
    assert estimate_chunk_size(400, 10.0, 9.9, 1.0) == capped


@pytest.mark.parametrize("name, args", [
    ("nic_bandwidth_gbps", (0, 9.4, 1.0, 0.05)),
    ("nic_bandwidth_gbps", (-1, 9.4, 1.0, 0.05)),
    ("nic_bandwidth_gbps", ("400", 9.4, 1.0, 0.05)),
    ("nic_bandwidth_gbps", (True, 9.4, 1.0, 0.05)),
    ("layer_compute_ms", (400, 0, 1.0, 0.05)),
    ("layer_compute_ms", (400, -9.4, 1.0, 0.05)),
    ("layer_compute_ms", (400, None, 1.0, 0.05)),
    ("ag_time_ms", (400, 9.4, 0, 0.05)),
    ("ag_time_ms", (400, 9.4, -1.0, 0.05)),
    ("max_ag_delay_fraction", (400, 9.4, 1.0, 0)),
    ("max_ag_delay_fraction", (400, 9.4, 1.0, -0.1)),
    ("max_ag_delay_fraction", (400, 9.4, 1.0, 1.5)),
    ("max_ag_delay_fraction", (400, 9.4, 1.0, "0.05")),
    ("max_ag_delay_fraction", (400, 9.4, 1.0, math.nan)),
])
def test_invalid_input_raises_value_error_naming_the_parameter(name, args):
    with pytest.raises(ValueError, match=name):
        estimate_chunk_size(*args)


@pytest.mark.parametrize("name, args", [
    ("nic_bandwidth_gbps", (math.nan, 9.4, 1.0, 0.05)),
    ("nic_bandwidth_gbps", (math.inf, 9.4, 1.0, 0.05)),
    ("layer_compute_ms", (400, math.nan, 1.0, 0.05)),
    ("layer_compute_ms", (400, math.inf, 1.0, 0.05)),
    ("ag_time_ms", (400, 9.4, math.nan, 0.05)),
])
def test_non_finite_input_raises_value_error_naming_the_parameter(name, args):
    with pytest.raises(ValueError, match=name):
        estimate_chunk_size(*args)


def test_bool_fraction_rejected():
    with pytest.raises(ValueError, match="max_ag_delay_fraction"):
        estimate_chunk_size(400, 9.4, 1.0, True)


@pytest.mark.parametrize("ag_time_ms", [9.4, 9.5, 100.0])
def test_exposed_all_gather_raises(ag_time_ms):
    with pytest.raises(ValueError, match="ag_time_ms") as info:
        estimate_chunk_size(400, 9.4, ag_time_ms, 0.05)
    assert "layer_compute_ms" in str(info.value)
