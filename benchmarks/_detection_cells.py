"""The detection campaign's cells, their fault-kit campaigns, and how a trial is scored.

Pure Python (no torch): `detection_bench.py` runs the cells, `_detection_ranks.py` trains them.

A cell is a JSON dict with a `class` and the fields of that class:

  sdc, non_finite  kind, surface, position, lifetime (non_finite is kind "nan")
  clean            nothing is injected
  hang             framework ("ddp" or "fsdp2")
  straggler        variant ("start_2x", "start_5x", "layer_5x")

plus `trial` and `faulty` (the rank the fault is injected on).
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

INTERVAL = 4          # SCOUT checks at steps 4, 8, 12, ...
STEPS = 20            # one hidden rotation (3 blocks) after the latest onset, plus one check
WORK_S = 0.03         # every rank's simulated compute per step, a sleep in the middle block
HANG_THRESHOLD_S = 2.0
QUIET_THRESHOLD_S = 10.0   # the hang threshold of every other class: load must not look like a hang
HANG_AT = 6
HANG_S = 2.5 * HANG_THRESHOLD_S
STRAGGLER_ONSET = 3

CLASSES = ("sdc", "non_finite", "clean", "hang", "straggler")
KINDS = ("sign_flip", "exponent_bit", "low_mantissa_bit", "small_add", "nan")
SURFACES = ("output", "parameter", "gradient", "optimizer_state")
POSITIONS = {"first": "embed", "middle": "layers.1", "final_norm": "norm", "head": "head"}
LIFETIMES = {"recurring": 5, "at_check": 2 * INTERVAL, "between_checks": 2 * INTERVAL - 2}
FRAMEWORKS = ("ddp", "fsdp2")
# (surface, module, delay in WORK_S): a step's forward is WORK_S plus 5 to 20 ms of real compute on
# the loaded 2-core machine, so a start-of-step delay of 1.5 WORK_S makes the rank about 2x slower.
STRAGGLERS = {"start_2x": ("process", "", 1.5), "start_5x": ("process", "", 5.0),
              "layer_5x": ("output", "layers.1", 4.0)}

# The fault kit's tensor-corruption parameters of each kind: one element of the tensor.
_KIND_PARAMETERS = {
    "sign_flip": {"operation": "sign_flip"},
    "exponent_bit": {"operation": "bit_flip", "magnitude": "severe"},        # highest exponent bit
    "low_mantissa_bit": {"operation": "bit_flip", "magnitude": "subtle"},    # lowest mantissa bit
    "small_add": {"operation": "add", "magnitude": "subtle"},                # + 1e-3
    "nan": {"operation": "nan"},
}

# Why a cell is outside SCOUT's guarantee (docs/scout.md, "What SCOUT does not detect" and
# "Live output"); such a cell is listed apart and never counted as a miss.
ONE_SHOT_OUTPUT = ("one-shot output corruption between checks: the gradient all-reduce makes every replica "
                   "equal before any check sees it (docs/scout.md: one-shot transient corruption)")
NOT_LIVE_COMPARED = ("one-shot output corruption at a check outside the live comparison: only the source's "
                     "live output of a module sampled at that step joins the vote (docs/scout.md: Live output)")
MASKED = ("the corruption left no trace: every replica's parameters and optimizer state were bitwise "
          "equal at the end (rounded away), so there was nothing to detect")


def source_rank(step: int, world: int) -> int:
    """The rank whose inputs SCOUT replays at `step` (every class rotates the same way)."""
    return (step // INTERVAL) % world


def cells(classes: Sequence[str], trials: int, world: int, clean_runs: int,
          kinds: Sequence[str] = KINDS, surfaces: Sequence[str] = SURFACES,
          positions: Sequence[str] = tuple(POSITIONS), lifetimes: Sequence[str] = tuple(LIFETIMES),
          frameworks: Sequence[str] = FRAMEWORKS, stragglers: Sequence[str] = tuple(STRAGGLERS)) -> List[dict]:
    """Every trial of the campaign, in run order. The faulty rank rotates over trials; a one-shot
    fault at a check starts on that check's source rank (the only rank whose live output is voted)."""
    out: List[dict] = []
    for cls in classes:
        if cls in ("sdc", "non_finite"):
            chosen = [k for k in kinds if (k == "nan") == (cls == "non_finite")]
            grid = [dict(kind=k, surface=s, position=p, lifetime=lt)
                    for lt in lifetimes for s in surfaces for p in positions for k in chosen]
        elif cls == "clean":
            grid = [{} for _ in range(clean_runs)]
        elif cls == "hang":
            grid = [dict(framework=f) for f in frameworks]
        else:
            grid = [dict(variant=v) for v in stragglers]
        repeat = 1 if cls == "clean" else trials
        for index, fields in enumerate(grid):
            for trial in range(repeat):
                if fields.get("lifetime") == "at_check":
                    faulty = (source_rank(LIFETIMES["at_check"], world) + trial) % world
                else:
                    faulty = (index + trial + 1) % world
                out.append(dict(fields, **{"class": cls, "trial": trial if repeat > 1 else index,
                                           "faulty": faulty}))
    return out


def cell_name(cell: dict) -> str:
    keys = {"sdc": ("kind", "surface", "position", "lifetime"), "non_finite": ("surface", "position", "lifetime"),
            "hang": ("framework",), "straggler": ("variant",), "clean": ()}[cell["class"]]
    return "/".join([cell["class"], *(cell[k] for k in keys), f"rank{cell['faulty']}", f"t{cell['trial']}"])


def row_of(cell: dict) -> str:
    """The table row a cell is summed into."""
    cls = cell["class"]
    if cls == "sdc":
        return f"sdc {cell['lifetime']} {cell['surface']}"
    if cls == "non_finite":
        return f"non_finite {cell['lifetime']}"
    if cls == "hang":
        return f"hang {cell['framework']}"
    if cls == "straggler":
        return f"straggler {cell['variant']}"
    return "clean"


def onset(cell: dict) -> int:
    """The iteration the fault is first injected in (the kit's clock)."""
    if cell["class"] in ("sdc", "non_finite"):
        return LIFETIMES[cell["lifetime"]]
    return {"hang": HANG_AT, "straggler": STRAGGLER_ONSET}.get(cell["class"], 0)


def campaign_json(cell: dict) -> Optional[dict]:
    """The fault kit's campaign manifest for `cell` (None for a clean run)."""
    cls, rank = cell["class"], cell["faulty"]
    if cls == "clean":
        return None
    if cls in ("sdc", "non_finite"):
        at = LIFETIMES[cell["lifetime"]]
        # A recurring fault is one permanent occurrence: in effect from its onset until the run ends.
        trigger = {"at": [at]}
        lifetime = {"permanent": True} if cell["lifetime"] == "recurring" else {"matching_calls": 1}
        fault = {"type": "tensor_corruption",
                 "target": {"rank": rank, "surface": cell["surface"], "module_path": POSITIONS[cell["position"]]},
                 "parameters": dict(_KIND_PARAMETERS[cell["kind"]], scope="element")}
    elif cls == "hang":
        trigger, lifetime = {"at": [HANG_AT]}, {"matching_calls": 1}
        fault = {"type": "hang", "target": {"rank": rank, "surface": "input", "module_path": "layers.1"},
                 "parameters": {"seconds": HANG_S}}
    else:
        surface, module, work = STRAGGLERS[cell["variant"]]
        trigger, lifetime = {"at": [STRAGGLER_ONSET]}, {"permanent": True}
        target: Dict[str, Any] = {"rank": rank, "surface": surface}
        if module:
            target["module_path"] = module
        fault = {"type": "delay", "target": target, "parameters": {"seconds": work * WORK_S}}
    incident = {"incident_id": "cell", "trigger": trigger, "lifetime": lifetime,
                "faults": [dict(fault, fault_id="fault")]}
    return {"schema_version": 1, "name": "detection-cell", "seed": cell["trial"], "incidents": [incident]}


def expected_kind(cell: dict) -> Optional[str]:
    return {"sdc": "sdc", "non_finite": "sdc", "hang": "hang", "straggler": "compute_straggler"}.get(cell["class"])


def by_design(cell: dict, plan: Dict[str, Any]) -> Optional[str]:
    """Why `cell` is outside the guarantee, or None when SCOUT must detect it. `plan` maps each
    check step to the modules sampled there and their source rank (from the run itself)."""
    if cell["class"] != "sdc" or cell["surface"] != "output":
        return None
    if cell["lifetime"] == "between_checks":
        return ONE_SHOT_OUTPUT
    if cell["lifetime"] == "at_check":
        sampled = plan.get(str(LIFETIMES["at_check"]), {})
        module = POSITIONS[cell["position"]]
        if not any(path == module and source == cell["faulty"] for path, source in sampled.values()):
            return NOT_LIVE_COMPARED
    return None


def _dedupe(reports: Iterable[dict]) -> List[dict]:
    """Every peer reports the same replay fault: one per (kind, ranks, resource, step)."""
    seen: Dict[Tuple, dict] = {}
    for r in sorted(reports, key=lambda r: r["detected_at"]):
        seen.setdefault((r["kind"], tuple(r["ranks"]), r["resource"], r["step"]), r)
    return list(seen.values())


def slowdown(cell: dict, ranks: List[dict]) -> Optional[float]:
    """A straggler's realized slowdown: its median forward time from the onset on over the
    median of its peers' (the forward holds the start-of-step and middle-block delays)."""
    if cell["class"] != "straggler" or not all(r.get("forward_s") for r in ranks):
        return None
    since = slice(STRAGGLER_ONSET - 1, None)
    own = statistics.median(ranks[cell["faulty"]]["forward_s"][since])
    peers = statistics.median(t for i, r in enumerate(ranks) if i != cell["faulty"] for t in r["forward_s"][since])
    return round(own / peers, 2)


def score(cell: dict, ranks: List[dict]) -> dict:
    """One trial from every rank's result (`reports`, `injections`, `state`, `plan`).

    outcome: hit (a report of the expected kind named exactly the faulty rank), miss,
    by_design (missed, and outside the guarantee: `reason`), masked (missed, and no replica's state
    differed: nothing to detect), not_injected (the kit recorded no injection), or clean.
    false_reports: deduplicated reports that name another rank, a group, or the wrong kind.
    latency: steps from the onset to the first hit (stragglers: checks, onset's included;
    hangs: seconds from the hang's start). slowdown: a straggler's realized slowdown."""
    reports = _dedupe(r for result in ranks for r in result["reports"])
    kind = expected_kind(cell)
    hits = [r for r in reports if kind is not None and r["kind"] == kind and r["ranks"] == [cell["faulty"]]]
    out: Dict[str, Any] = {"false_reports": [r for r in reports if r not in hits], "latency": None, "reason": None,
                           "slowdown": slowdown(cell, ranks)}
    injected = [i for result in ranks for i in result["injections"] if i["status"] == "injected"]
    if cell["class"] == "clean":
        out["outcome"] = "clean"
    elif hits:
        first = min(hits, key=lambda r: (r["step"], r["detected_at"]))
        out["outcome"] = "hit"
        if cell["class"] == "hang":
            out["latency"] = round(first["detected_at"] - min(i["wall_time"] for i in injected), 3)
        elif cell["class"] == "straggler":
            out["latency"] = first["step"] // INTERVAL - (onset(cell) - 1) // INTERVAL
        else:
            out["latency"] = first["step"] - onset(cell)
    elif not injected:
        out["outcome"] = "not_injected"
    else:
        reason = by_design(cell, ranks[0]["plan"])
        states = {tuple(result["state"]) for result in ranks}
        if reason is None and cell["class"] == "sdc" and cell["surface"] != "output" and len(states) == 1:
            reason = MASKED
        out["outcome"] = "miss" if reason is None else ("masked" if reason == MASKED else "by_design")
        out["reason"] = reason
        if out["slowdown"] is not None:
            out["reason"] = f"realized slowdown {out['slowdown']}x (forward time against the peers' median)"
    return out


def _ratio(num: int, den: int) -> str:
    return "-" if den == 0 else f"{num / den:.2f}"


def summarize(scored: List[dict]) -> List[dict]:
    """One table row per `row_of` group: counts, precision, recall, false-positive rate, latency."""
    rows = []
    for name in dict.fromkeys(row_of(s["cell"]) for s in scored):
        group = [s for s in scored if row_of(s["cell"]) == name]
        count = {o: sum(s["outcome"] == o for s in group) for o in
                 ("hit", "miss", "by_design", "masked", "not_injected", "error")}
        false = sum(len(s["false_reports"]) for s in group)
        latencies = [s["latency"] for s in group if s["latency"] is not None]
        unit = {"hang": "s", "straggler": "checks"}.get(group[0]["cell"]["class"], "steps")
        rows.append({
            "class": name, "trials": len(group), "hit": count["hit"], "miss": count["miss"],
            "by design": count["by_design"], "masked": count["masked"],
            "other": count["not_injected"] + count["error"],
            "precision": _ratio(count["hit"], count["hit"] + false),
            "recall": _ratio(count["hit"], count["hit"] + count["miss"]),
            "FPR": _ratio(sum(bool(s["false_reports"]) for s in group), len(group)),
            "latency": (f"{statistics.median(latencies):g} / {max(latencies):g} {unit}" if latencies else "-"),
            "slowdown": "/".join(f"{s['slowdown']:g}x" for s in group if s.get("slowdown") is not None) or "-",
        })
    return rows
