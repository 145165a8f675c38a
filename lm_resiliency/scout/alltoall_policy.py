"""AllToAll replay: what SCOUT captured of a training AllToAll, and the traffic matrices a policy
replays on its process group (the executor is `scout.alltoall`).

`AllToAllCapture` describes one Python-visible `all_to_all_single` / `all_to_all` call: its group,
its row layout (trailing shape, dtype), its position among the step's calls on that group, and
the reconstructed split matrix. A policy turns a capture into square `AllToAllTrafficMatrix`
values (rows sent from group rank i to group rank j); the default sends at most a balanced and a
cyclic-permutation matrix within a per-rank byte budget.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

ALL_TO_ALL_OPS = ("all_to_all_single", "all_to_all")
DEFAULT_MAX_PAYLOAD_BYTES_PER_RANK = 4 * 1024 * 1024


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _square(rows: Sequence[Sequence[int]], what: str) -> Tuple[Tuple[int, ...], ...]:
    matrix = tuple(tuple(r) for r in rows)
    n = len(matrix)
    if not n or any(len(r) != n for r in matrix) or not all(_count(v) for r in matrix for v in r):
        raise ValueError(f"{what}: must be a non-empty square matrix of non-negative ints, got {rows!r}")
    return matrix


@dataclass(frozen=True)
class AllToAllTrafficMatrix:
    """`rows[i][j]`: tensor rows group rank i sends to group rank j. `name` labels it in reports."""

    rows: Tuple[Tuple[int, ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", _square(self.rows, "AllToAllTrafficMatrix.rows"))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"AllToAllTrafficMatrix.name: must be a non-empty string, got {self.name!r}")

    @property
    def size(self) -> int:
        return len(self.rows)

    def sent_by(self, i: int) -> Tuple[int, ...]:
        return self.rows[i]

    def received_by(self, j: int) -> Tuple[int, ...]:
        return tuple(r[j] for r in self.rows)


@dataclass(frozen=True)
class AllToAllCapture:
    """One captured AllToAll call.

    `group_ranks`: global ranks of its process group, in group-rank order; `op`:
    "all_to_all_single" or "all_to_all"; `row_shape` / `dtype`: one row's trailing shape and the
    element type; `sequence`: its position among the step's calls on this group (0-based);
    `observed_splits`: the training split matrix (rows group rank i sent to j) when every member's
    input splits were seen, else None."""

    group_ranks: Tuple[int, ...]
    op: str
    row_shape: Tuple[int, ...]
    dtype: torch.dtype
    sequence: int
    observed_splits: Optional[Tuple[Tuple[int, ...], ...]] = None

    def __post_init__(self) -> None:
        if self.op not in ALL_TO_ALL_OPS:
            raise ValueError(f"AllToAllCapture.op: must be one of {ALL_TO_ALL_OPS}, got {self.op!r}")
        if not self.group_ranks or len(set(self.group_ranks)) != len(self.group_ranks) \
                or not all(_count(r) for r in self.group_ranks):
            raise ValueError(f"AllToAllCapture.group_ranks: distinct ranks needed, got {self.group_ranks!r}")
        if not all(_count(d) for d in self.row_shape):
            raise ValueError(f"AllToAllCapture.row_shape: must be non-negative ints, got {self.row_shape!r}")
        if self.observed_splits is not None:
            splits = _square(self.observed_splits, "AllToAllCapture.observed_splits")
            object.__setattr__(self, "observed_splits", splits)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()


class AllToAllReplayPolicy(ABC):
    """Generates the matrices replayed for one capture. Return them in an order that depends only
    on what equivalent replicas share (group size, row layout, sequence position)."""

    @abstractmethod
    def generate(self, capture: AllToAllCapture) -> Sequence[AllToAllTrafficMatrix]:
        """One or more square matrices of `len(capture.group_ranks)` rows."""


@dataclass(frozen=True)
class BalancedAndPermutationPolicy(AllToAllReplayPolicy):
    """At most two matrices within `max_payload_bytes_per_rank` sent per rank (one row minimum):
    a balanced matrix (every route the same rows: concurrent peer traffic) and a cyclic
    permutation (sender i's whole budget to `i + shift`, the shift set by the sequence position),
    which keeps every rank's send and receive volume equal. A one-rank group gets the balanced one."""

    max_payload_bytes_per_rank: int = DEFAULT_MAX_PAYLOAD_BYTES_PER_RANK

    def __post_init__(self) -> None:
        if not _count(self.max_payload_bytes_per_rank) or self.max_payload_bytes_per_rank < 1:
            raise ValueError("BalancedAndPermutationPolicy.max_payload_bytes_per_rank: must be a positive int, "
                             f"got {self.max_payload_bytes_per_rank!r}")

    def generate(self, capture: AllToAllCapture) -> Sequence[AllToAllTrafficMatrix]:
        n = len(capture.group_ranks)
        budget_rows = max(1, self.max_payload_bytes_per_rank // max(1, capture.row_bytes))
        per_route = max(1, budget_rows // n)
        matrices = [AllToAllTrafficMatrix(tuple(tuple(per_route for _ in range(n)) for _ in range(n)), "balanced")]
        if n > 1:
            shift = 1 + capture.sequence % (n - 1)
            rows = tuple(tuple(budget_rows if j == (i + shift) % n else 0 for j in range(n)) for i in range(n))
            matrices.append(AllToAllTrafficMatrix(rows, f"permutation+{shift}"))
        return matrices
