"""The two-panel picture of a run: what happened per optimizer step, and progress over wall time.

One renderer for `lm-resiliency timeline` (a real run, from its event log) and `make demo` (which
adds losses, an uninterrupted baseline and the fault kit's injections). It draws a `Picture`:

- top: per optimizer step. With losses, the loss of every generation (log scale) over the
  baseline's; without, one lane per generation from the step it resumed at to its last step,
  with its captures. Restarts are arrows back to the recovered step, so the re-done steps show;
  faults injected are dotted lines, localizations crosses.
- bottom: optimizer step over wall time, one colour per generation, launches as dashed lines,
  the time between the end of a generation and the first step of the next shaded.

matplotlib is optional (`pip install "lm-resiliency[demo]"`): `draw` returns a note instead of
drawing when it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from lm_resiliency.files import make_parents

GEN_COLORS = ("#2ca02c", "#17becf", "#bcbd22", "#8c564b", "#e377c2", "#7f7f7f", "#1f77b4", "#ff7f0e")
MISSING_MATPLOTLIB = ("matplotlib is not installed, so no picture is drawn: pip install \"lm-resiliency[demo]\" "
                      "(or pip install matplotlib)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    """One launch of the run (a torchrun restart or a relaunch).

    `points` are (optimizer step, wall time, loss or None), in order; `stopped_at` is when its end
    began (a detection), `ended_at` when it was over; `end` says how it ended, in words."""

    index: int
    launched_at: float
    ended_at: Optional[float]
    resumed_step: Optional[int]
    end: str
    points: Tuple[Tuple[int, float, Optional[float]], ...]
    stopped_at: Optional[float] = None
    captures: Tuple[int, ...] = ()

    @property
    def last_step(self) -> Optional[int]:
        return self.points[-1][0] if self.points else self.resumed_step


@dataclass(frozen=True, kw_only=True, slots=True)
class Mark:
    """Something that happened at a step and/or a time: a fault "injected", or "localized".
    `detail` is added to the label in the per-step panel (e.g. the rank)."""

    kind: str
    label: str
    detail: str = ""
    step: Optional[int] = None
    t: Optional[float] = None
    color: str = "#444444"
    generation: Optional[int] = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Picture:
    title: str
    started_at: float
    max_step: int
    generations: Tuple[Generation, ...]
    marks: Tuple[Mark, ...] = ()
    baseline: Tuple[Tuple[int, float, Optional[float]], ...] = ()
    localized_legend: str = "localized"


def draw(picture: Picture, path: str) -> Optional[str]:
    """Write the picture to `path` (PNG); returns None, or a note saying why nothing was drawn."""
    try:
        import matplotlib
    except ImportError:
        return MISSING_MATPLOTLIB
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 9.5), gridspec_kw={"height_ratios": [1.15, 1]})
    fig.suptitle(picture.title, fontsize=13)
    if any(loss is not None for gen in picture.generations for _, _, loss in gen.points):
        _loss_panel(top, picture)
    else:
        _lanes_panel(top, picture)
    _progress_panel(bottom, picture)
    fig.tight_layout()
    make_parents(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _color(index: int) -> str:
    return GEN_COLORS[index % len(GEN_COLORS)]


def _by_step(marks: List[Mark]) -> Dict[int, List[Mark]]:
    grouped: Dict[int, List[Mark]] = {}
    for mark in marks:
        if mark.step is not None:
            grouped.setdefault(mark.step, []).append(mark)
    return dict(sorted(grouped.items()))


def _injections(ax: Any, picture: Picture, ymax: float) -> None:
    for step, marks in _by_step([m for m in picture.marks if m.kind == "injected"]).items():
        for i, mark in enumerate(marks):
            ax.axvline(step + 0.08 * i, color=mark.color, ls=":", lw=1.4, zorder=2)
        text = "\n".join(f"{m.label} ({m.detail})" if m.detail else m.label for m in marks)
        ax.annotate(text, (step, ymax), xytext=(3, -3), textcoords="offset points", va="top", ha="left",
                    fontsize=8, color=marks[0].color)


def _loss_panel(ax: Any, picture: Picture) -> None:
    gens = picture.generations
    curves = {g.index: {s: loss for s, _, loss in g.points if loss is not None} for g in gens}
    base = {s: loss for s, _, loss in picture.baseline if loss is not None}

    def loss_at(index: Optional[int], step: int) -> Optional[float]:
        """Loss of generation `index` at `step` (or its last step before it); any generation as fallback."""
        for i in ([index] if index is not None else []) + [g.index for g in reversed(gens)]:
            before = {s: v for s, v in curves.get(i, {}).items() if s <= step}
            if before:
                return before[max(before)]
        return None

    if base:
        ax.plot(list(base), list(base.values()), color="#999999", lw=6, alpha=0.35, label="uninterrupted baseline",
                zorder=1)
    for gen in gens:
        pts = curves.get(gen.index, {})
        if pts:
            ax.plot(list(pts), list(pts.values()), "-o", ms=3.5, lw=1.6, color=_color(gen.index), zorder=3,
                    label=f"generation {gen.index}: steps {min(pts)}-{max(pts)} ({gen.end})")
    ax.set_yscale("log")
    values = [v for pts in curves.values() for v in pts.values()] + list(base.values())
    if values:
        ax.set_ylim(min(values) / 1.45, max(values) * 1.25)  # room for the labels
    _injections(ax, picture, ax.get_ylim()[1])
    for mark in picture.marks:
        if mark.kind == "localized" and mark.step is not None:
            y = loss_at(mark.generation, mark.step)
            if y is not None:
                ax.plot([mark.step], [y], "X", ms=12, color=mark.color, markeredgecolor="white", zorder=6)
    for prev, gen in zip(gens, gens[1:]):
        prev_pts = curves.get(prev.index, {})
        if not prev_pts or gen.resumed_step is None:
            continue
        start = (max(prev_pts), prev_pts[max(prev_pts)])
        end = (gen.resumed_step, loss_at(prev.index, gen.resumed_step) or start[1])
        _restart_arrow(ax, start, end, gen.resumed_step)
    ax.set_ylabel("training loss (mean over ranks, log)")
    ax.plot([], [], ":", color="#555555", label="fault injected (dotted line)")
    _finish_step_panel(ax, picture, "loss per step: every generation resumes from its recovered step and rejoins "
                                    "the baseline")


def _lanes_panel(ax: Any, picture: Picture) -> None:
    gens = picture.generations
    for gen in gens:
        color = _color(gen.index)
        first = gen.resumed_step or 0
        last = gen.last_step if gen.last_step is not None else first
        ax.plot([first, last], [gen.index, gen.index], "-", lw=6, alpha=0.55, color=color, solid_capstyle="butt",
                label=f"generation {gen.index}: steps {first}-{last} ({gen.end})", zorder=3)
        if gen.captures:
            ax.plot(list(gen.captures), [gen.index] * len(gen.captures), "|", ms=14, mew=1.5, color="#333333",
                    zorder=4)
    for prev, gen in zip(gens, gens[1:]):
        if prev.last_step is not None and gen.resumed_step is not None:
            _restart_arrow(ax, (prev.last_step, prev.index), (gen.resumed_step, gen.index), gen.resumed_step)
    localized = [m for m in picture.marks if m.kind == "localized" and m.step is not None]
    for i, mark in enumerate(localized):
        lane = mark.generation if mark.generation is not None else 0
        ax.plot([mark.step], [lane], "X", ms=12, color=mark.color, markeredgecolor="white", zorder=6)
        ax.annotate(mark.label, (mark.step, lane), xytext=(4, 8 if i % 2 == 0 else -16), textcoords="offset points",
                    fontsize=8, color=mark.color)  # alternate above and below: neighbours do not overlap
    ax.set_ylim(len(gens) - 0.4, -0.6)
    _injections(ax, picture, -0.6)
    ax.set_yticks(range(len(gens)))
    ax.set_yticklabels([f"gen {g.index}" for g in gens])
    ax.set_ylabel("generation (launch)")
    ax.plot([], [], "|", color="#333333", ms=10, label="GEMINI capture")
    _finish_step_panel(ax, picture, "steps per generation: each restart resumes at its recovered step (arrow); "
                                    "the overlap is the work done again")


def _restart_arrow(ax: Any, start: Tuple[float, float], end: Tuple[float, float], step: int) -> None:
    ax.annotate("", xy=end, xytext=start, zorder=4,
                arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.2, connectionstyle="arc3,rad=0.5"))
    ax.annotate(f"restart -> {step}", end, xytext=(-8, -22), textcoords="offset points", fontsize=8,
                color="#333333", ha="center", bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))


def _finish_step_panel(ax: Any, picture: Picture, title: str) -> None:
    ax.set_xlabel("optimizer step (training iteration)")
    ax.grid(alpha=0.25)
    ax.set_xlim(0, picture.max_step + 1)
    ax.plot([], [], "X", color="#555555", ms=9, label=picture.localized_legend)
    ax.legend(loc="lower left", fontsize=8, ncol=1, framealpha=0.92)
    ax.set_title(title, fontsize=10)


def _progress_panel(ax: Any, picture: Picture) -> None:
    t0 = picture.started_at
    gens = picture.generations
    base_step = picture.baseline[0][0] if picture.baseline else None
    first = [t for s, t, _ in (gens[0].points if gens else ()) if s == base_step]
    if picture.baseline and first:
        shift = first[0] - picture.baseline[0][1]  # the baseline ran earlier: align its first step
        ax.plot([t + shift - t0 for _, t, _ in picture.baseline], [s for s, _, _ in picture.baseline],
                color="#999999", lw=5, alpha=0.35, label="uninterrupted baseline (aligned at its first step)")
    for gen in gens:
        color = _color(gen.index)
        ax.axvline(gen.launched_at - t0, color=color, ls="--", lw=1, alpha=0.8)
        ax.annotate(f"gen {gen.index} launched", (gen.launched_at - t0, 0.5), xytext=(3, 0),
                    textcoords="offset points", fontsize=7, color=color, rotation=90, va="bottom")
        if gen.points:
            ax.plot([t - t0 for _, t, _ in gen.points], [s for s, _, _ in gen.points], "-o", ms=2.5, color=color,
                    label=f"generation {gen.index}")
    for prev, gen in zip(gens, gens[1:]):
        resumed = [t for s, t, _ in gen.points if gen.resumed_step is None or s > gen.resumed_step]
        if resumed and prev.ended_at is not None:
            began = prev.stopped_at if prev.stopped_at is not None else prev.ended_at
            ax.axvspan(began - t0, min(resumed) - t0, color="#d62728", alpha=0.07)
    for step, marks in _by_step([m for m in picture.marks if m.kind == "injected"]).items():
        timed = [(mark.t - t0, mark) for mark in marks if mark.t is not None]
        if not timed:
            continue
        for t, mark in timed:
            ax.plot([t], [step], "v", ms=10, color=mark.color, markeredgecolor="white", zorder=5)
        label_t, label_mark = timed[0]
        ax.annotate(" + ".join(mark.label for _, mark in timed), (label_t, step), xytext=(-6, 6),
                    textcoords="offset points", fontsize=8, ha="right", color=label_mark.color)
    for mark in picture.marks:
        if mark.kind == "localized" and mark.t is not None and mark.step is not None:
            ax.plot([mark.t - t0], [mark.step], "X", ms=12, color=mark.color, markeredgecolor="white", zorder=6)
    if any(m.kind == "injected" for m in picture.marks):
        ax.plot([], [], "v", color="#555555", ms=8, label="fault injected")
    ax.plot([], [], "X", color="#555555", ms=9, label=picture.localized_legend)
    ax.fill_between([], [], color="#d62728", alpha=0.12, label="end of a generation -> first new step")
    ax.set_xlabel("wall time since the run started (s)")
    ax.set_ylabel("optimizer step")
    ax.set_ylim(0, picture.max_step + 1)
    ax.grid(alpha=0.25)
    ax.legend(loc="upper left", fontsize=8, ncol=2, framealpha=0.92)
    ax.set_title("progress over wall time: detection latency, restart cost and re-done steps of each failure",
                 fontsize=10)
