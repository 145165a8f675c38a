"""select_mode: the recovery-trust table, with every full-sweep outcome."""

import pytest

from lm_resiliency.recovery import RecoveryMode, SweepOutcome, select_mode

LATEST, VERIFIED = RecoveryMode.LATEST, RecoveryMode.RECOVERY_VERIFIED


@pytest.mark.parametrize("failure", ["hang", "uncertain"])
@pytest.mark.parametrize("sweep, mode, reason", [
    (SweepOutcome.CLEAN, LATEST, "the full replay sweep completed clean"),
    (SweepOutcome.SDC, VERIFIED, "the full replay sweep detected SDC"),
    (SweepOutcome.INCOMPLETE, VERIFIED, "the full replay sweep did not complete"),
    (SweepOutcome.NOT_RUN, VERIFIED, "no replay evidence is available"),
])
def test_hang_and_uncertain_follow_the_sweep(failure, sweep, mode, reason):
    assert select_mode(failure, all_ranks_accessible=True, sweep=sweep) == (mode, f"{failure}: {reason}")


def test_no_sweep_is_missing_evidence():
    assert select_mode("hang", all_ranks_accessible=True) == (VERIFIED, "hang: no replay evidence is available")


@pytest.mark.parametrize("sweep", list(SweepOutcome))
def test_inaccessible_rank_ignores_even_a_clean_sweep(sweep):
    assert select_mode("hang", all_ranks_accessible=False, sweep=sweep) == (
        VERIFIED, "a required rank or machine is inaccessible")
    assert select_mode("inaccessible", all_ranks_accessible=True, sweep=sweep)[0] is VERIFIED


@pytest.mark.parametrize("sweep", list(SweepOutcome))
def test_detected_sdc_is_verified_whatever_the_sweep(sweep):
    assert select_mode("sdc", all_ranks_accessible=True, sweep=sweep) == (
        VERIFIED, "silent data corruption was detected")


@pytest.mark.parametrize("failure", ["straggler", "dataloader_stall", "checkpoint_io_stall"])
@pytest.mark.parametrize("sweep", list(SweepOutcome))
def test_accessible_stalls_select_latest_without_a_sweep(failure, sweep):
    assert select_mode(failure, all_ranks_accessible=True, sweep=sweep) == (
        LATEST, f"{failure}: every rank is accessible and state is not suspect")


def test_unknown_failure_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown failure class 'crash'; expected one of 'straggler', 'hang'"):
        select_mode("crash", all_ranks_accessible=True)
