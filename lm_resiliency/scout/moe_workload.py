"""MoE replay workloads: which modules an expert check replays, at which execution regimes.

A regime (a *recipe*) is how many rows each local expert executes. Grouped-GEMM kernels pick
their tiling by those counts, so SDC that hides in one regime shows only when the replay runs
that regime. A workload holds a catalog of recipes; each scheduled check replays one recipe, so
one *cycle* of K checks covers the catalog. A materializer turns the invocation the source
captured in training into the invocation of a recipe, on the source, before it is shared.

    workload = ReplayWorkload.from_moe_catalog(catalog, replay_modules=[model.experts],
                                               materializer=GroupedExpertMaterializer())
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lm_resiliency.errors import ResiliencyError

Recipe = Union[int, Tuple[int, ...]]   # scalar n_exec, or one row count per local expert
InputKey = Union[int, str]             # a positional index or a keyword name

PEER_ROLES = ("dense", "expert")
CATALOG_SCHEMA = "lm-resiliency/moe-replay-catalog/v1"


class MaterializationError(ResiliencyError, ValueError):
    """A captured invocation does not fit the materializer's contract (the error says which input)."""


def _is_count(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_key(value: Any, field: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not (_is_count(value) or (isinstance(value, str) and value)):
        raise ValueError(f"{field}: must be a positional index (int >= 0) or a keyword name, got {value!r}")


def _get(args: tuple, kwargs: dict, key: InputKey, what: str) -> Any:
    if isinstance(key, int):
        if key >= len(args):
            raise MaterializationError(f"{what} is positional input {key}, but the call had {len(args)} positional "
                                       "inputs")
        return args[key]
    if key not in kwargs:
        raise MaterializationError(f"{what} is keyword input {key!r}, absent from the call ({sorted(kwargs)})")
    return kwargs[key]


def _resize_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with `rows` leading rows: the captured rows cycled (deterministic), zeros without any."""
    if t.shape[0] == 0:
        return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    index = torch.arange(rows, device=t.device) % t.shape[0]
    return t.index_select(0, index).contiguous()


def _resize_aligned(args: tuple, kwargs: dict, old_rows: int, new_rows: int,
                    skip: Sequence[InputKey]) -> Tuple[tuple, dict]:
    """Every tensor input with `old_rows` leading rows (except `skip`) resized to `new_rows`."""
    def fix(key: InputKey, value: Any) -> Any:
        if key in skip or not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != old_rows:
            return value
        return _resize_rows(value, new_rows)
    return (tuple(fix(i, v) for i, v in enumerate(args)), {k: fix(k, v) for k, v in kwargs.items()})


@dataclass(frozen=True)
class GroupedExpertMaterializer:
    """The `(tokens, tokens_per_expert, probabilities)` expert-boundary contract.

    For a scalar recipe `n_exec` every local expert count becomes `n_exec` (rounded up to a
    multiple of `alignment`) and every token-aligned input (leading dimension equal to the
    captured token count: tokens, probabilities, ...) is resized to `count * local_experts` rows,
    by cycling the captured rows. A per-expert recipe gives each local expert its own count.
    `counts_input` names the count argument (index or keyword); the count tensor's length is
    the local expert count."""

    tokens_input: InputKey = 0
    counts_input: InputKey = 1
    alignment: int = 1

    def __post_init__(self) -> None:
        _check_key(self.tokens_input, "GroupedExpertMaterializer.tokens_input")
        _check_key(self.counts_input, "GroupedExpertMaterializer.counts_input")
        if self.tokens_input == self.counts_input:
            raise ValueError("GroupedExpertMaterializer: tokens_input and counts_input name the same input "
                             f"{self.tokens_input!r}")
        if not _is_count(self.alignment, 1):
            raise ValueError(f"GroupedExpertMaterializer.alignment: must be a positive int, got {self.alignment!r}")

    def _aligned(self, n: int) -> int:
        return math.ceil(n / self.alignment) * self.alignment

    def materialize(self, args: tuple, kwargs: dict, recipe: Recipe) -> Tuple[tuple, dict]:
        """The invocation of `recipe` made from a captured one (new tensors; the capture is kept)."""
        tokens = _get(args, kwargs, self.tokens_input, "tokens")
        counts = _get(args, kwargs, self.counts_input, "tokens_per_expert")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 1:
            raise MaterializationError(f"tokens ({self.tokens_input!r}) must be a tensor with a row dimension")
        if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.is_floating_point():
            raise MaterializationError(f"tokens_per_expert ({self.counts_input!r}) must be a 1-D integer tensor "
                                       "with one count per local expert")
        experts = counts.numel()
        if int(counts.sum()) != tokens.shape[0]:
            raise MaterializationError(f"tokens_per_expert sums to {int(counts.sum())} but tokens has "
                                       f"{tokens.shape[0]} rows")
        per_expert = [recipe] * experts if isinstance(recipe, int) else list(recipe)
        if len(per_expert) != experts:
            raise MaterializationError(f"recipe {recipe!r} has {len(per_expert)} counts, the call has {experts} "
                                       "local experts")
        new_counts = [self._aligned(n) for n in per_expert]
        args, kwargs = _resize_aligned(args, kwargs, tokens.shape[0], sum(new_counts), (self.counts_input,))
        counts_tensor = torch.tensor(new_counts, dtype=counts.dtype, device=counts.device)
        if isinstance(self.counts_input, int):
            args = args[:self.counts_input] + (counts_tensor,) + args[self.counts_input + 1:]
        else:
            kwargs = dict(kwargs, **{self.counts_input: counts_tensor})
        return args, kwargs


@dataclass(frozen=True)
class LeadingDimensionMaterializer:
    """For an expert boundary with no count or offset metadata: a scalar recipe `n_exec` resizes
    every input whose leading dimension equals that of `rows_input` to `n_exec` rows."""

    rows_input: InputKey = 0

    def __post_init__(self) -> None:
        _check_key(self.rows_input, "LeadingDimensionMaterializer.rows_input")

    def materialize(self, args: tuple, kwargs: dict, recipe: Recipe) -> Tuple[tuple, dict]:
        if not isinstance(recipe, int):
            raise MaterializationError(f"LeadingDimensionMaterializer takes scalar recipes (rows), got {recipe!r}")
        rows = _get(args, kwargs, self.rows_input, "the row input")
        if not isinstance(rows, torch.Tensor) or rows.dim() < 1:
            raise MaterializationError(f"input {self.rows_input!r} must be a tensor with a leading dimension")
        return _resize_aligned(args, kwargs, rows.shape[0], recipe, ())


Materializer = Union[GroupedExpertMaterializer, LeadingDimensionMaterializer]


def _recipe(value: Any, where: str) -> Recipe:
    if isinstance(value, Mapping):
        keys = set(value) - {"regime", "observed"}  # the discovery command's annotations
        if keys == {"n_exec"}:
            value = value["n_exec"]
        elif keys == {"counts"}:
            value = value["counts"]
        else:
            raise ValueError(f"{where}: a recipe mapping holds 'n_exec' (rows per local expert) or 'counts' "
                             f"(one per local expert), got keys {sorted(value)}")
    if _is_count(value, 1):
        return int(value)
    if isinstance(value, (list, tuple)) and value and all(_is_count(v) for v in value) and sum(value) > 0:
        return tuple(int(v) for v in value)
    raise ValueError(f"{where}: a recipe is a positive int n_exec or a non-empty list of counts (ints >= 0, "
                     f"not all 0), got {value!r}")


def _recipes(catalog: Any) -> Tuple[Recipe, ...]:
    if isinstance(catalog, Mapping):
        if catalog.get("schema") != CATALOG_SCHEMA:
            raise ValueError(f"catalog: schema must be {CATALOG_SCHEMA!r} (lm-resiliency-discover-moe-regimes "
                             f"output), got {catalog.get('schema')!r}")
        if catalog.get("complete") is not True:
            raise ValueError(f"catalog: not complete ({catalog.get('problems')}); replay only a qualified catalog "
                             "(see lm-resiliency-discover-moe-regimes)")
        catalog = catalog.get("recipes")
    if not isinstance(catalog, (list, tuple)) or not catalog:
        raise ValueError(f"catalog: needs at least one recipe, got {catalog!r}")
    recipes = tuple(_recipe(r, f"catalog recipe {i}") for i, r in enumerate(catalog))
    if len(set(recipes)) != len(recipes):
        raise ValueError(f"catalog: recipes repeat ({list(recipes)}); each regime once")
    return recipes


def recipe_label(recipe: Recipe) -> str:
    return f"n_exec={recipe}" if isinstance(recipe, int) else "counts=" + ",".join(map(str, recipe))


@dataclass(frozen=True, eq=False)
class ReplayWorkload:
    """What a workload check replays: `replay_modules` (rotated when `ReplayHarnessConfig.rotate_layers`)
    at each catalog recipe in turn (one per scheduled check), materialized by `materializer`.

    `peer_role="expert"` replays among expert-data-parallel peers (equal EP and expert-TP
    coordinates); `"dense"` among the dense data-parallel peers. `device_mesh` names the layout
    when the model's parameters do not carry it (a `DeviceMesh` whose dimensions include an
    expert-parallel one: "ep"; expert data parallel: "edp" or a data-parallel name; expert TP:
    "etp")."""

    recipes: Tuple[Recipe, ...]
    replay_modules: Tuple[nn.Module, ...]
    materializer: Materializer
    peer_role: str = "expert"
    device_mesh: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipes", _recipes(list(self.recipes)))
        modules = tuple(self.replay_modules)
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise ValueError("ReplayWorkload.replay_modules: needs one or more nn.Module objects of the model")
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError("ReplayWorkload.replay_modules: a module appears twice")
        object.__setattr__(self, "replay_modules", modules)
        if not isinstance(self.materializer, (GroupedExpertMaterializer, LeadingDimensionMaterializer)):
            raise TypeError("ReplayWorkload.materializer: must be a GroupedExpertMaterializer or "
                            f"LeadingDimensionMaterializer, got {type(self.materializer).__name__}")
        if self.peer_role not in PEER_ROLES:
            raise ValueError(f"ReplayWorkload.peer_role: must be one of {PEER_ROLES}, got {self.peer_role!r}")
        if self.device_mesh is not None and not hasattr(self.device_mesh, "mesh_dim_names"):
            raise TypeError(f"ReplayWorkload.device_mesh: must be a DeviceMesh, got {type(self.device_mesh).__name__}")

    @classmethod
    def from_moe_catalog(cls, catalog: Any, *, replay_modules: Sequence[nn.Module],
                         materializer: Optional[Materializer] = None, device_mesh: Any = None) -> "ReplayWorkload":
        """An expert-replay workload from a regime catalog: the JSON document
        `lm-resiliency-discover-moe-regimes` writes (loaded with `json.load`), or a list of recipes
        (`n_exec` ints, per-expert count lists, or `{"n_exec": n}` / `{"counts": [...]}`)."""
        return cls(recipes=_recipes(catalog), replay_modules=tuple(replay_modules),
                   materializer=materializer if materializer is not None else GroupedExpertMaterializer(),
                   peer_role="expert", device_mesh=device_mesh)

    @classmethod
    def from_shapes(cls, shapes: Sequence[Any], *, replay_modules: Sequence[nn.Module],
                    materializer: Optional[Materializer] = None, peer_role: str = "dense",
                    device_mesh: Any = None) -> "ReplayWorkload":
        """A custom workload: `shapes` are recipes (leading-dimension rows by default, through a
        `LeadingDimensionMaterializer`). Pass `peer_role="expert"` for an expert module."""
        return cls(recipes=_recipes(list(shapes)), replay_modules=tuple(replay_modules),
                   materializer=materializer if materializer is not None else LeadingDimensionMaterializer(),
                   peer_role=peer_role, device_mesh=device_mesh)

    def describe(self) -> Dict[str, Any]:
        """JSON-ready summary (recipes, role, materializer) for logs and reports."""
        return {"recipes": [recipe_label(r) for r in self.recipes], "peer_role": self.peer_role,
                "materializer": type(self.materializer).__name__}

