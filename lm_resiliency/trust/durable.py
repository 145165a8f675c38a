"""The framework's own durable checkpoint store, as certification drives it.

`DurableCheckpointAdapter` is what certification calls; `CallbackDurableCheckpointAdapter`
builds one from four plain callables; `DurableCheckpointConfig` connects it to a manifest
directory (see `trust.manifests`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from lm_resiliency._values import ConfigError

ADAPTER_METHODS = ("save_candidate", "load_checkpoint", "commit_candidate", "quarantine_candidate")


@runtime_checkable
class DurableCheckpointAdapter(Protocol):
    """What certification needs from the framework's own checkpoint store (see
    `CallbackDurableCheckpointAdapter` for the contract of each method)."""

    def save_candidate(self, step: int) -> str: ...
    def load_checkpoint(self, checkpoint_id: str, step: int) -> None: ...
    def commit_candidate(self, checkpoint_id: str, step: int) -> None: ...
    def quarantine_candidate(self, checkpoint_id: str, step: int, reason: str) -> None: ...


@dataclass(frozen=True)
class CallbackDurableCheckpointAdapter:
    """A durable-checkpoint adapter built from four plain callables.

    Contract (rank 0 of the checkpoint group calls the first, third and fourth; every rank calls
    `load_checkpoint_fn`):

    - ``save_candidate_fn(step) -> str``: write the framework checkpoint of the training state
      at optimizer step `step` (the state at the SCOUT boundary, before the next forward) and
      return its checkpoint id: a non-empty string, unique for every save (never the id of a
      RECOVERY_VERIFIED checkpoint; reusing a candidate's or quarantined id is allowed). Return
      only once the bytes are durable. It runs on rank 0 only: if the framework's save is
      collective, the callback must coordinate the other ranks itself.
    - ``load_checkpoint_fn(checkpoint_id, step)``: restore the training state from that
      checkpoint, on the calling rank. Called only with a RECOVERY_VERIFIED checkpoint.
    - ``commit_candidate_fn(checkpoint_id, step)``: the candidate is now RECOVERY_VERIFIED;
      make it permanent (for example: protect it from retention). Idempotent.
    - ``quarantine_candidate_fn(checkpoint_id, step, reason)``: the candidate must never be used
      for recovery (`reason` says why: detected SDC, or an uncertified cycle); the framework may
      delete or move it. Idempotent.

    Any exception fails the boundary on every rank with `DurableCheckpointError`.
    """

    save_candidate_fn: Callable[[int], str]
    load_checkpoint_fn: Callable[[str, int], None]
    commit_candidate_fn: Callable[[str, int], None]
    quarantine_candidate_fn: Callable[[str, int, str], None]

    def __post_init__(self) -> None:
        for name in ("save_candidate_fn", "load_checkpoint_fn", "commit_candidate_fn", "quarantine_candidate_fn"):
            value = getattr(self, name)
            if not callable(value):
                raise ConfigError(f"CallbackDurableCheckpointAdapter.{name}: must be callable, got "
                                  f"{type(value).__name__} {value!r}")

    def save_candidate(self, step: int) -> str:
        """Save the candidate at `step`; returns its checkpoint id."""
        return self.save_candidate_fn(step)

    def load_checkpoint(self, checkpoint_id: str, step: int) -> None:
        """Restore the RECOVERY_VERIFIED checkpoint `checkpoint_id` (taken at `step`)."""
        self.load_checkpoint_fn(checkpoint_id, step)

    def commit_candidate(self, checkpoint_id: str, step: int) -> None:
        """Mark the candidate RECOVERY_VERIFIED in the framework store."""
        self.commit_candidate_fn(checkpoint_id, step)

    def quarantine_candidate(self, checkpoint_id: str, step: int, reason: str) -> None:
        """Exclude the candidate from recovery for `reason`."""
        self.quarantine_candidate_fn(checkpoint_id, step, reason)


@dataclass(frozen=True)
class DurableCheckpointConfig:
    """Connects SCOUT certification to framework-owned durable checkpoints.

    manifest_dir: where certification manifests live (created 0700). It needs durability
        equivalent to the framework checkpoint store and must be readable by every rank.
    environment_id: identifies the job environment; manifests written for another one are
        refused when read.
    adapter: the framework callbacks (`CallbackDurableCheckpointAdapter` or any object with
        ``save_candidate``, ``load_checkpoint``, ``commit_candidate``, ``quarantine_candidate``).
    """

    manifest_dir: str
    environment_id: str
    adapter: DurableCheckpointAdapter

    def __post_init__(self) -> None:
        directory: object = self.manifest_dir
        if isinstance(directory, os.PathLike):
            directory = os.fspath(directory)
        if not isinstance(directory, str) or not directory.strip():
            raise ConfigError(f"DurableCheckpointConfig.manifest_dir: must be a non-empty path string, got "
                              f"{self.manifest_dir!r}")
        object.__setattr__(self, "manifest_dir", directory)
        if not isinstance(self.environment_id, str) or not self.environment_id.strip():
            raise ConfigError(f"DurableCheckpointConfig.environment_id: must be a non-empty string, got "
                              f"{self.environment_id!r}")
        missing = [name for name in ADAPTER_METHODS if not callable(getattr(self.adapter, name, None))]
        if missing:
            raise ConfigError(f"DurableCheckpointConfig.adapter: must provide callable "
                              f"{', '.join(ADAPTER_METHODS)}; {type(self.adapter).__name__} lacks "
                              f"{', '.join(missing)}")
