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
