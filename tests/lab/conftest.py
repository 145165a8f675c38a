"""Lab tests run on simulated hosts (lab/): they skip with the reason where the lab cannot run."""

from __future__ import annotations

from typing import Callable, List, Sequence

import pytest

from lab import Lab, unavailable_reason


@pytest.fixture
def make_lab() -> Callable[..., Lab]:
    """`make_lab(["h1", "h2"], **kwargs)`: a started lab, torn down after the test whatever happens."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    made: List[Lab] = []

    def make(hosts: Sequence[str], **kwargs) -> Lab:
        lab = Lab(hosts, **kwargs)
        made.append(lab)
        return lab

    yield make
    for lab in made:
        lab.teardown()


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> dict:
    """The final state of the uninterrupted torchrun run on hosts h1, h2, h3 (2 workers each) that
    the lab's recovery tests compare with bitwise (tests/lab/torchrun_hosts.py)."""
    from tests.lab import torchrun_hosts

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with Lab(["h1", "h2", "h3"]) as lab:
        return torchrun_hosts.uninterrupted(lab, str(tmp_path_factory.mktemp("baseline")), ["h1", "h2", "h3"],
                                            store_host="h3")
