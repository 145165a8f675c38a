"""When incidents happen: the campaign clock, triggers, lifetimes and retrigger policies."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Optional, Tuple

from ._fields import (ObjectReader, build, check_non_negative_int, check_positive_int, coerce_enum,
                      fail, is_number)


class ClockType(str, Enum):
    """TRAINING_ITERATION: ticks are optimizer iterations (1 = the first optimizer step of the
    run), advanced by the optimizer post-step hook. WALL_CLOCK: ticks are whole seconds since the
    clock origin, read at each iteration start."""

    TRAINING_ITERATION = "training_iteration"
    WALL_CLOCK = "wall_clock"


class ClockOrigin(str, Enum):
    """RUN_START: tick 1 is the first iteration (or second) of the whole run; a restarted worker
    resumes the count (iterations from the recovered step, seconds from the run's first attach
    time kept in the campaign state store), so occurrence ids stay the same across restarts.
    GENERATION_START: the clock starts over in every worker process."""

    RUN_START = "run_start"
    GENERATION_START = "generation_start"


class RetriggerPolicy(str, Enum):
    """What happens when a restarted or replacement worker reaches an occurrence again.

    ONCE: an occurrence is injected at most once per rank for the whole run: the worker claims
    it in the campaign state store (atomic compare-and-swap) before injecting, so a replayed
    iteration, or an old and a replacement worker running side by side, never inject it twice.
    EVERY_GENERATION: injected once per worker generation (torchrun restart count), so a
    replayed iteration is hit again, like a deterministic hardware fault.
    """

    ONCE = "once"
    EVERY_GENERATION = "every_generation"


@dataclass(frozen=True)
class ClockSpec:
    type: ClockType = ClockType.TRAINING_ITERATION
    origin: ClockOrigin = ClockOrigin.RUN_START

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", coerce_enum(ClockType, self.type, "ClockSpec.type"))
        object.__setattr__(self, "origin", coerce_enum(ClockOrigin, self.origin, "ClockSpec.origin"))

    def to_json(self) -> Dict[str, Any]:
        return {"type": self.type.value, "origin": self.origin.value}

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "ClockSpec":
        r = ObjectReader(doc, path, (), ("type", "origin"))
        return build(cls, path, **r.kwargs("type", "origin"))


@dataclass(frozen=True)
class IterationRange:
    """Ticks `start <= t < stop` (stop None: no end), every `every`-th one from `start`."""

    start: int
    stop: Optional[int] = None
    every: int = 1

    def __post_init__(self) -> None:
        check_non_negative_int(self.start, "IterationRange.start")
        if self.stop is not None:
            check_non_negative_int(self.stop, "IterationRange.stop")
            if self.stop <= self.start:
                fail("IterationRange.stop", f"must be greater than start ({self.start}), got {self.stop}")
        check_positive_int(self.every, "IterationRange.every")

    def __contains__(self, tick: object) -> bool:
        return (isinstance(tick, int) and tick >= self.start
                and (self.stop is None or tick < self.stop) and (tick - self.start) % self.every == 0)

    def to_json(self) -> Dict[str, Any]:
        return {"start": self.start, "stop": self.stop, "every": self.every}

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "IterationRange":
        r = ObjectReader(doc, path, ("start",), ("stop", "every"))
        return build(cls, path, **r.kwargs("start", "stop", "every"))


def probability_draw(seed: int, incident_id: str, tick: int) -> float:
    """Uniform [0, 1) draw that depends only on (campaign seed, incident, tick): every rank and
    every restart computes the same one."""
    digest = hashlib.sha256(f"{seed}\0{incident_id}\0{tick}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


@dataclass(frozen=True)
class IncidentTrigger:
    """At which ticks an incident occurs.

    `at`: explicit ticks; `range`: an IterationRange; `probability`: fire with this probability
    at each candidate tick (those of `at`/`range`, or every tick when neither is given), drawn
    from the campaign seed and the occurrence identity so it is reproducible. `at` and `range`
    are mutually exclusive; at least one of the three must be given.
    """

    at: Tuple[int, ...] = ()
    range: Optional[IterationRange] = None
    probability: Optional[float] = None

    def __post_init__(self) -> None:
        at = self.at
        if isinstance(at, list):
            at = tuple(at)
        if not isinstance(at, tuple):
            fail("IncidentTrigger.at", f"must be a tuple of ticks, got {type(at).__name__}")
        for i, tick in enumerate(at):
            check_non_negative_int(tick, f"IncidentTrigger.at[{i}]")
        if len(set(at)) != len(at):
            fail("IncidentTrigger.at", f"ticks must be unique, got {list(at)}")
        object.__setattr__(self, "at", tuple(sorted(at)))
        if self.range is not None and not isinstance(self.range, IterationRange):
            fail("IncidentTrigger.range", f"must be an IterationRange, got {type(self.range).__name__}")
        if self.at and self.range is not None:
            fail("IncidentTrigger", "give either at or range, not both")
        if self.probability is not None:
            if not is_number(self.probability) or not 0.0 < self.probability <= 1.0:
                fail("IncidentTrigger.probability", f"must be a number in (0, 1], got {self.probability!r}")
            object.__setattr__(self, "probability", float(self.probability))
        if not self.at and self.range is None and self.probability is None:
            fail("IncidentTrigger", "needs at, range or probability")

    def fires(self, tick: int, *, seed: int, incident_id: str) -> bool:
        if self.at and tick not in self.at:
            return False
        if self.range is not None and tick not in self.range:
            return False
        if self.probability is not None and self.probability < 1.0:
            return probability_draw(seed, incident_id, tick) < self.probability
        return True

    def to_json(self) -> Dict[str, Any]:
        doc: Dict[str, Any] = {}
        if self.at:
            doc["at"] = list(self.at)
        if self.range is not None:
            doc["range"] = self.range.to_json()
        if self.probability is not None:
            doc["probability"] = self.probability
        return doc

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "IncidentTrigger":
        r = ObjectReader(doc, path, (), ("at", "range", "probability"))
        kwargs = r.kwargs("probability")
        if "at" in r:
            kwargs["at"] = tuple(item for item, _ in r.list("at"))
        if "range" in r and r.get("range") is not None:
            kwargs["range"] = IterationRange.from_json(r.get("range"), r.at("range"))
        return build(cls, path, **kwargs)


@dataclass(frozen=True)
class IncidentLifetime:
    """How long an occurrence stays armed once triggered. Exactly one of:

    `matching_calls`: for this many matching calls of each fault (forward calls for OUTPUT/INPUT,
    optimizer steps for GRADIENT and stale state, batches for DATALOADER, iterations otherwise);
    `iterations`: for this many iterations (the trigger tick and the next ones), every matching
    call in them; `permanent`: until the run ends (a permanent, recurring fault).
    Neither given means `matching_calls=1` (a one-shot fault).
    """

    matching_calls: Optional[int] = None
    iterations: Optional[int] = None
    permanent: bool = False

    def __post_init__(self) -> None:
        if self.matching_calls is not None:
            check_positive_int(self.matching_calls, "IncidentLifetime.matching_calls")
        if self.iterations is not None:
            check_positive_int(self.iterations, "IncidentLifetime.iterations")
        if not isinstance(self.permanent, bool):
            fail("IncidentLifetime.permanent", f"must be true or false, got {self.permanent!r}")
        given = [n for n, v in (("matching_calls", self.matching_calls), ("iterations", self.iterations),
                                ("permanent", self.permanent or None)) if v is not None]
        if len(given) > 1:
            fail("IncidentLifetime",
                 f"give exactly one of matching_calls, iterations, permanent; got {given}")
        if not given:
            object.__setattr__(self, "matching_calls", 1)

    @property
    def call_limit(self) -> float:
        return float(self.matching_calls) if self.matching_calls is not None else math.inf

    def to_json(self) -> Dict[str, Any]:
        if self.permanent:
            return {"permanent": True}
        if self.iterations is not None:
            return {"iterations": self.iterations}
        return {"matching_calls": self.matching_calls}

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "IncidentLifetime":
        r = ObjectReader(doc, path, (), ("matching_calls", "iterations", "permanent"))
        return build(cls, path, **r.kwargs("matching_calls", "iterations", "permanent"))


__all__ = ["ClockOrigin", "ClockSpec", "ClockType", "IncidentLifetime", "IncidentTrigger",
           "IterationRange", "RetriggerPolicy", "probability_draw"]
