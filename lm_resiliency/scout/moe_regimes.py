"""`lm-resiliency-discover-moe-regimes`: a SCOUT MoE replay catalog from saved profiler observations.

    lm-resiliency-discover-moe-regimes --observations obs.json --environment env.json \\
        --request request.json --output catalog.json

Inputs (JSON, strict: unknown or missing fields are errors):
- observations `{"schema": "lm-resiliency/moe-observations/v1", "observations": [{"layer": str,
  "step": int, "tokens_per_expert": [int, ...]}]}`: per-local-expert row counts the profiler saw
  at the expert stage.
- environment `{"schema": "lm-resiliency/moe-environment/v1", "environment_id": str,
  "local_experts": int, "alignment": int, "regime_boundaries": [int, ...]}`: the row counts at
  which the expert kernels change regime (ascending, first 1): regime i is
  `[boundaries[i], boundaries[i+1])`, the last one open-ended.
- request `{"schema": "lm-resiliency/moe-regime-request/v1", "layers": [str, ...],
  "max_recipes": int, "require_complete": bool}`.

Qualification: every observed nonzero count falls in one regime; each observed regime gets one
recipe, `n_exec` = its most frequent count rounded up to `alignment` (smallest on ties), which
must stay inside the regime. The catalog is *complete* when every requested layer has
observations and every observed regime has a recipe within `max_recipes`; *exact* when, in
addition, every observed count equals its regime's `n_exec` (otherwise a recipe represents its
regime's other counts). An incomplete catalog with `require_complete` is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

from lm_resiliency.files import (INPUT, RecordRejected, RecordSchema, array, atomic_write, boolean, check_record,
                                 decode_record, integer, nested, read_file_bytes, text)
from lm_resiliency.scout.moe_workload import CATALOG_SCHEMA

logger = logging.getLogger(__name__)

OBSERVATIONS_SCHEMA = "lm-resiliency/moe-observations/v1"
ENVIRONMENT_SCHEMA = "lm-resiliency/moe-environment/v1"
REQUEST_SCHEMA = "lm-resiliency/moe-regime-request/v1"
MAX_INPUT_BYTES = 64 * 1024 * 1024


class RegimeInputError(RecordRejected):
    """An input document breaks its schema; the message names the file and the field."""


_COUNTS = array(integer(0), nonempty=True, max_length=None)
_NAMES = array(text(), nonempty=True, max_length=None)
ENVIRONMENT_DOC = RecordSchema(what="MoE environment", identity=("schema", ENVIRONMENT_SCHEMA),
                               max_bytes=MAX_INPUT_BYTES, fields={
                                   "environment_id": text(), "local_experts": integer(1), "alignment": integer(1),
                                   "regime_boundaries": _COUNTS})
REQUEST_DOC = RecordSchema(what="MoE regime request", identity=("schema", REQUEST_SCHEMA), max_bytes=MAX_INPUT_BYTES,
                           fields={"layers": _NAMES, "max_recipes": integer(1), "require_complete": boolean()})
_OBSERVATION = RecordSchema(what="MoE observation",
                            fields={"layer": text(), "step": integer(0), "tokens_per_expert": _COUNTS})
OBSERVATIONS_DOC = RecordSchema(what="MoE observations", identity=("schema", OBSERVATIONS_SCHEMA),
                                max_bytes=MAX_INPUT_BYTES,
                                fields={"observations": array(nested(_OBSERVATION), max_length=None)})


def _load(path: str, what: str, schema: RecordSchema) -> Any:
    """The JSON in the input file `path` (a regular file the user named; checked by `discover`)."""
    where = f"{what} {path}"
    data = read_file_bytes(path, what, max_bytes=schema.max_bytes, trust=INPUT, shown=where, error=RegimeInputError)
    if data is None:
        raise RegimeInputError(f"{where}: no such file")
    return decode_record(data, schema, where, error=RegimeInputError)


def discover(observations: Any, environment: Any, request: Any) -> Dict[str, Any]:
    """The catalog document (`ReplayWorkload.from_moe_catalog` reads it). Raises RegimeInputError."""
    env = check_record(environment, ENVIRONMENT_DOC, "environment", error=RegimeInputError)
    bounds: List[int] = env["regime_boundaries"]
    if bounds[0] != 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise RegimeInputError(f"environment.regime_boundaries: invalid value {bounds!r} (ascending row counts, "
                               "the first 1)")
    req = check_record(request, REQUEST_DOC, "request", error=RegimeInputError)
    if len(set(req["layers"])) != len(req["layers"]):
        raise RegimeInputError(f"request.layers: invalid value {req['layers']!r} (a layer is named twice)")
    obs = check_record(observations, OBSERVATIONS_DOC, "observations", error=RegimeInputError)
    seen: Dict[str, int] = {}
    counts: Counter = Counter()
    for i, entry in enumerate(obs["observations"]):
        if len(entry["tokens_per_expert"]) != env["local_experts"]:
            raise RegimeInputError(f"observations.observations[{i}].tokens_per_expert: "
                                   f"{len(entry['tokens_per_expert'])} counts, the environment has "
                                   f"{env['local_experts']} local experts")
        if entry["layer"] not in req["layers"]:
            raise RegimeInputError(f"observations.observations[{i}].layer: {entry['layer']!r} is not a requested "
                                   f"layer {req['layers']}")
        seen[entry["layer"]] = seen.get(entry["layer"], 0) + 1
        counts.update(c for c in entry["tokens_per_expert"] if c > 0)
    by_regime: Dict[int, Counter] = {}
    for count, n in counts.items():
        regime = max(i for i, b in enumerate(bounds) if b <= count)
        by_regime.setdefault(regime, Counter())[count] += n
    recipes = []
    for regime in sorted(by_regime):
        lo, hi = bounds[regime], bounds[regime + 1] if regime + 1 < len(bounds) else None
        top = max(by_regime[regime].values())
        common = min(c for c, n in by_regime[regime].items() if n == top)
        n_exec = math.ceil(common / env["alignment"]) * env["alignment"]
        if hi is not None and n_exec >= hi:
            raise RegimeInputError(f"environment.alignment: {env['alignment']} rounds regime [{lo}, {hi}) out of "
                                   f"itself ({common} -> {n_exec}); the regime boundaries must be aligned")
        recipes.append({"n_exec": n_exec, "regime": [lo, hi], "observed": sum(by_regime[regime].values())})
    missing = [layer for layer in req["layers"] if layer not in seen]
    over = max(0, len(recipes) - req["max_recipes"])
    problems = ([f"no observations for layers {missing}"] if missing else []) + \
        ([f"{len(recipes)} observed regimes exceed max_recipes {req['max_recipes']}"] if over else []) + \
        (["no nonzero expert counts observed"] if not recipes else [])
    complete = not problems
    if not complete and req["require_complete"]:
        raise RegimeInputError("the catalog is incomplete: " + "; ".join(problems))
    recipes = recipes[:req["max_recipes"]]
    exact = complete and all(set(by_regime[r]) == {rec["n_exec"]} for r, rec in zip(sorted(by_regime), recipes))
    return {"schema": CATALOG_SCHEMA, "environment_id": env["environment_id"], "layers": req["layers"],
            "recipes": recipes, "complete": complete, "exact": exact, "problems": problems}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lm-resiliency-discover-moe-regimes",
                                     description="Build a SCOUT MoE replay catalog from profiler observations.")
    parser.add_argument("--observations", required=True, help="saved profiler observations (JSON)")
    parser.add_argument("--environment", required=True, help="environment description (JSON)")
    parser.add_argument("--request", required=True, help="request manifest (JSON)")
    parser.add_argument("--output", default="-", help="catalog path (default: stdout)")
    args = parser.parse_args(argv)
    try:
        catalog = discover(_load(args.observations, "observations", OBSERVATIONS_DOC),
                           _load(args.environment, "environment", ENVIRONMENT_DOC),
                           _load(args.request, "request", REQUEST_DOC))
    except RegimeInputError as exc:
        sys.stderr.write(f"lm-resiliency-discover-moe-regimes: error: {exc}\n")
        return 2
    text = json.dumps(catalog, indent=2, sort_keys=True) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        atomic_write(args.output, text.encode("utf-8"), mode=0o644)  # the user's own output file
    return 0


if __name__ == "__main__":
    sys.exit(main())
