"""The picture of a torture run: one self-contained HTML page (inline CSS and SVG, no scripts,
nothing fetched) showing the verdict, each client's ids/s over time, the faults as bands behind
the lines, the errors as red crosses, and tables of the faults and the counts.

`render_html(summary)` takes the run's summary as loaded from JSON and tolerates missing
optional fields: a page for a half-written summary is more use than a traceback.
"""

from __future__ import annotations

import html
import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["render_html"]

# Rate points drawn per process: about one per pixel of the chart's width.
MAX_POINTS = 1000
# Error crosses drawn per page; beyond this the page gets heavy and the crosses a red smear.
MAX_ERROR_MARKS = 2000
# Rows of the fault table; faults over their bound are always listed.
MAX_FAULT_ROWS = 2000
# Above this many processes the errors go on one shared row instead of one row each.
MAX_ERROR_ROWS = 30
# Above this many processes, lines share colours by strategy.
MAX_COLOURED = 20

# Twenty colours told apart on white; none is the red kept for errors and failures.
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#393b79",
    "#f0a30a",
    "#006d5b",
    "#a05195",
    "#5c7a29",
    "#6baed6",
    "#fd8d3c",
    "#74c476",
    "#9e9ac8",
    "#c49c94",
    "#333333",
)
FAULT_PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#9d755d", "#eeca3b", "#72b7b2")
RED = "#d62728"
# Written as names: the linter rightly flags look-alike characters in literals.
DASH = "\N{EN DASH}"
TIMES = "\N{MULTIPLICATION SIGN}"
GREEN = "#1a7f37"

# The chart's geometry, in viewBox units (the SVG scales to the page's width).
WIDTH = 1200
LEFT = 120  # room for the y labels and the names of the error rows
RIGHT = 20
TOP = 10
PLOT_H = 340
ROW_H = 14
AXIS_H = 42
PLOT_W = WIDTH - LEFT - RIGHT
LABEL_LANES = 3
# Beyond this many faults, labels on the bands are a wall of text: the kinds' legend under the
# chart and each band's hover title name them instead.
MAX_LABELLED_FAULTS = 40


@dataclass
class Process:
    name: str
    strategy: str
    rate: list[tuple[float, float]]
    errors: list[tuple[float, str]]
    colour: str = PALETTE[0]


@dataclass
class Fault:
    kind: str
    target: str
    start: float
    end: float | None
    longest_gap: float | None = None
    bound: float | None = None
    ok: bool | None = None


@dataclass
class Mark:
    """The errors of one row that fall on one pixel column: drawn as one cross."""

    row: int
    x: int
    times: list[float] = field(default_factory=list)
    names: Counter[str] = field(default_factory=Counter)


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _float(value: Any) -> float | None:
    """A finite number, or None for anything else (missing, text, NaN)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _pairs(value: Any) -> list[tuple[float, Any]]:
    """The [time, value] pairs of a series whose time is a finite number; the rest skipped."""
    items = _list(value)
    try:
        # The fast way for a well-formed series: hours of samples are a few 100k pairs.
        pairs = [(float(t), v) for t, v in items]
    except (TypeError, ValueError):
        pairs = []
        for item in items:
            t = _float(item[0]) if isinstance(item, list | tuple) and len(item) >= 2 else None
            if t is not None:
                pairs.append((t, item[1]))
    return [(t, v) for t, v in pairs if math.isfinite(t)]


def _processes(timeline: dict[str, Any]) -> list[Process]:
    processes = []
    for name, raw in _dict(timeline.get("processes")).items():
        raw = _dict(raw)
        pairs = _pairs(raw.get("rate"))
        rate: list[tuple[float, float]]
        try:
            rate = [(t, float(v)) for t, v in pairs]
        except (TypeError, ValueError):
            rate = [(t, f) for t, v in pairs if (f := _float(v)) is not None]
        rate = sorted(point for point in rate if math.isfinite(point[1]))
        errors = [(t, str(what)) for t, what in _pairs(raw.get("errors"))]
        processes.append(Process(str(name), str(raw.get("strategy") or "?"), rate, errors))
    return processes


def _fault(raw: dict[str, Any]) -> Fault | None:
    start = _float(raw.get("start"))
    if start is None:
        return None
    end = _float(raw.get("end"))
    if end is not None and end < start:
        start, end = end, start
    gap, bound = _float(raw.get("longest_gap")), _float(raw.get("bound"))
    ok = raw.get("ok")
    if not isinstance(ok, bool):
        ok = None if gap is None or bound is None else gap <= bound
    return Fault(
        str(raw.get("kind") or "?"), str(raw.get("target") or ""), start, end, gap, bound, ok
    )


def _faults(raws: Any) -> list[Fault]:
    faults = [_fault(_dict(raw)) for raw in _list(raws)]
    return sorted((f for f in faults if f is not None), key=lambda f: f.start)


def _key(fault: Fault) -> tuple[str, str, float]:
    return fault.kind, fault.target, round(fault.start, 3)


# ---- numbers and ticks ------------------------------------------------------------------------


def fmt_time(t: float) -> str:
    """Seconds as a person reads them: 7.5s, 90s, 12m30s, 2h05m."""
    if abs(t) < 120:
        return f"{round(t, 1):g}s"
    total = round(t)
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m" + (f"{seconds:02d}s" if seconds else "")
    return f"{minutes}m" + (f"{seconds:02d}s" if seconds else "")


def fmt_rate(v: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= size:
            return f"{v / size:.3g}{suffix}"
    return f"{v:.3g}"


def fmt_seconds(t: float | None) -> str:
    return DASH if t is None else f"{t:.1f} s"


# Steps a clock reads naturally: a tick every 15 s or 5 min, never every 7.
TIME_STEPS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)


def time_ticks(t0: float, t1: float, most: int = 12) -> list[float]:
    span = t1 - t0
    step = next((s for s in TIME_STEPS if span / s <= most), 0.0)
    if not step:
        step = 3600 * math.ceil(span / most / 3600)
    first = math.ceil(t0 / step - 1e-9) * step
    return [first + i * step for i in range(int((t1 - first) / step + 1e-9) + 1)]


def rate_ticks(top: float, most: int = 6) -> tuple[float, list[float]]:
    """The y axis's top and its ticks: 1, 2 or 5 times a power of ten apart."""
    raw = max(top, 1e-9) / (most - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    count = max(1, math.ceil(top / step - 1e-9))
    return count * step, [i * step for i in range(count + 1)]


# ---- downsampling -----------------------------------------------------------------------------


def runs(points: Sequence[tuple[float, float]], gap: float) -> list[list[tuple[float, float]]]:
    """The points split where samples are missing for longer than `gap`: a client that was
    killed shows as a break in its line, not a straight line across its death."""
    out: list[list[tuple[float, float]]] = []
    last = -math.inf
    for point in points:
        if point[0] - last > gap or not out:
            out.append([])
        out[-1].append(point)
        last = point[0]
    return out


def decimate(
    run: Sequence[tuple[float, float]], t0: float, t1: float, bins: int
) -> list[tuple[float, float]]:
    """At most two points per time bin: the lowest and the highest, in time order. Averaging
    would hide the very thing the picture is for, a rate that drops to zero for a moment."""
    if len(run) <= 2 * bins:
        return list(run)
    width = (t1 - t0) / bins or 1.0
    out: list[tuple[float, float]] = []
    current = -1
    low = high = run[0]
    for point in run:
        b = int((point[0] - t0) / width)
        if b != current:
            if current >= 0:
                out.extend(sorted({low, high}))
            current, low, high = b, point, point
        elif point[1] < low[1]:
            low = point
        elif point[1] > high[1]:
            high = point
    out.extend(sorted({low, high}))
    return out


def sample_gap(process: Process, bucket: float | None) -> float:
    """How long without a sample breaks the line. The samples' own spacing counts as well as
    the bucket: a series sampled more sparsely than its bucket says must not fall into dots."""
    times = [t for t, _ in process.rate]
    steps = [b - a for a, b in itertools.pairwise(times) if b > a]
    spacing = statistics.median(steps) if steps else math.inf
    return 2.5 * max(bucket or 0.0, spacing)


# ---- the chart --------------------------------------------------------------------------------


class Chart:
    def __init__(self, t0: float, t1: float, top: float, rows: int) -> None:
        self.t0, self.t1, self.top, self.rows = t0, t1, top, rows
        self.strip_top = TOP + PLOT_H + (6 if rows else 0)
        self.axis_y = self.strip_top + rows * ROW_H
        self.height = self.axis_y + AXIS_H

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) / (self.t1 - self.t0) * PLOT_W

    def y(self, v: float) -> float:
        return TOP + PLOT_H - min(max(v, 0.0), self.top) / self.top * PLOT_H

    def row_y(self, row: int) -> float:
        return self.strip_top + row * ROW_H + ROW_H / 2


def _assign_colours(processes: list[Process]) -> list[tuple[str, str, list[Process]]]:
    """Colours the processes and returns the legend's entries: (colour, label, processes)."""
    if len(processes) <= MAX_COLOURED:
        for i, p in enumerate(processes):
            p.colour = PALETTE[i]
        return [(p.colour, p.name, [p]) for p in processes]
    by_strategy: dict[str, list[Process]] = {}
    for p in processes:
        by_strategy.setdefault(p.strategy, []).append(p)
    entries = []
    for i, (strategy, members) in enumerate(sorted(by_strategy.items())):
        colour = PALETTE[i % len(PALETTE)]
        for p in members:
            p.colour = colour
        entries.append((colour, f"{strategy} ({len(members)} processes)", members))
    return entries


def _fault_colours(faults: Iterable[Fault]) -> dict[str, str]:
    kinds = sorted({f.kind for f in faults})
    return {kind: FAULT_PALETTE[i % len(FAULT_PALETTE)] for i, kind in enumerate(kinds)}


def _fault_title(f: Fault, end: float) -> str:
    text = f"{f.kind} on {f.target or '?'}: {f.start:.1f}{DASH}{end:.1f} s"
    if f.end is None:
        text += " (no end recorded)"
    if f.longest_gap is not None:
        text += f"; longest outage {f.longest_gap:.2f} s"
    if f.bound is not None:
        text += f", bound {f.bound:.2f} s"
    if f.ok is False:
        text += ": OVER"
    return text


def _bands(chart: Chart, faults: list[Fault], colours: dict[str, str]) -> list[str]:
    out = []
    lanes: list[float] = [-math.inf] * (LABEL_LANES if len(faults) <= MAX_LABELLED_FAULTS else 0)
    bottom = chart.axis_y - TOP
    for f in faults:
        end = chart.t1 if f.end is None else f.end
        x0 = chart.x(f.start)
        w = max(chart.x(end) - x0, 1.5)
        colour = colours[f.kind]
        stroke = f' stroke="{RED}" stroke-width="1.5"' if f.ok is False else ""
        parts = [
            f'<g class="fault"><title>{esc(_fault_title(f, end))}</title>',
            f'<rect class="band" x="{x0:.1f}" y="{TOP}" width="{w:.1f}" height="{bottom}" '
            f'fill="{colour}" fill-opacity="0.16"{stroke}/>',
        ]
        # Labels go in the first lane free at this x, so overlapping faults stay legible;
        # when every lane is taken the band keeps only its hover title.
        label_w = 6.5 * len(f.kind) + 6
        lane = next((i for i, last in enumerate(lanes) if last < x0), None)
        if lane is not None:
            lanes[lane] = x0 + max(label_w, w)
            parts.append(
                f'<text class="band-label" x="{x0 + 2:.1f}" y="{TOP + 12 + 13 * lane}" '
                f'fill="{colour}">{esc(f.kind)}</text>'
            )
        parts.append("</g>")
        out.append("".join(parts))
    return out


def _lines(chart: Chart, processes: list[Process], bucket: float | None) -> list[str]:
    out = []
    bins = MAX_POINTS // 2
    for p in processes:
        if not p.rate:
            continue
        d = []
        for run in runs(p.rate, sample_gap(p, bucket)):
            pts = decimate(run, chart.t0, chart.t1, bins)
            coords = " ".join(f"{chart.x(t):.1f} {chart.y(v):.1f}" for t, v in pts)
            # A lone sample is a zero-length segment: with round caps it shows as a dot.
            d.append(f"M{coords}" + ("l0.01 0" if len(pts) == 1 else ""))
        out.append(
            f'<path class="rate" d="{"".join(d)}" stroke="{p.colour}">'
            f"<title>{esc(p.name)} ({esc(p.strategy)})</title></path>"
        )
    return out


def _marks(chart: Chart, processes: list[Process]) -> tuple[list[str], int, int]:
    """The error crosses, and how many crosses and errors were left out by the cap. Errors of
    one row on one pixel column share a cross (its title counts them): nothing is lost there."""
    shared = chart.rows == 1 and len(processes) > 1
    marks: dict[tuple[int, int], Mark] = {}
    for row, p in enumerate(processes):
        row = 0 if shared else row
        for t, name in p.errors:
            x = round(chart.x(t))
            mark = marks.setdefault((row, x), Mark(row, x))
            mark.times.append(t)
            mark.names[f"{p.name}: {name}" if shared else name] += 1
    ordered = sorted(marks.values(), key=lambda m: (m.x, m.row))
    kept = ordered
    if len(ordered) > MAX_ERROR_MARKS:
        # Evenly through time, so what is drawn still shows where errors cluster.
        step = len(ordered) / MAX_ERROR_MARKS
        kept = [ordered[int(i * step)] for i in range(MAX_ERROR_MARKS)]
    out = []
    for m in kept:
        y = chart.row_y(m.row)
        count = len(m.times)
        when = (
            fmt_seconds(m.times[0])
            if count == 1
            else (f"{count} errors, {min(m.times):.1f}{DASH}{max(m.times):.1f} s")
        )
        names = ", ".join(f"{n} {TIMES}{c}" if c > 1 else n for n, c in m.names.most_common())
        out.append(
            f'<path class="error" d="M{m.x - 3.5} {y - 3.5:.1f}l7 7m0 -7l-7 7">'
            f"<title>{esc(when)}: {esc(names)}</title></path>"
        )
    left_crosses = len(ordered) - len(kept)
    left_errors = sum(len(m.times) for m in ordered) - sum(len(m.times) for m in kept)
    return out, left_crosses, left_errors


def _axes(chart: Chart, ticks: list[float], rates: list[float]) -> list[str]:
    out = []
    right = LEFT + PLOT_W
    for v in rates:
        y = chart.y(v)
        out.append(f'<line class="grid" x1="{LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}"/>')
        out.append(f'<text class="ylabel" x="{LEFT - 6}" y="{y + 4:.1f}">{fmt_rate(v)}</text>')
    for t in ticks:
        x = chart.x(t)
        out.append(f'<line class="grid" x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{chart.axis_y}"/>')
        out.append(
            f'<text class="xlabel" x="{x:.1f}" y="{chart.axis_y + 16}">{esc(fmt_time(t))}</text>'
        )
    out.append(
        f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}"/>'
        f'<line class="axis" x1="{LEFT}" y1="{chart.axis_y}" x2="{right}" y2="{chart.axis_y}"/>'
        f'<text class="title" x="{LEFT + PLOT_W / 2}" y="{chart.axis_y + 36}">'
        "time since the run began</text>"
        f'<text class="title" transform="translate(16 {TOP + PLOT_H / 2}) rotate(-90)">'
        "ids/s</text>"
    )
    return out


def _row_labels(chart: Chart, processes: list[Process]) -> list[str]:
    if chart.rows == 0:
        return []
    if chart.rows == 1 and len(processes) > 1:
        labelled = [(0, "errors", "all processes")]
    else:
        labelled = [(i, p.name, f"{p.name} ({p.strategy})") for i, p in enumerate(processes)]
    out = []
    for row, name, title in labelled:
        y = chart.row_y(row)
        short = name if len(name) <= 17 else name[:16] + "…"
        out.append(
            f'<text class="rowlabel" x="{LEFT - 6}" y="{y + 3.5:.1f}"><title>{esc(title)}</title>'
            f"{esc(short)}</text>"
        )
        if row % 2:
            out.append(
                f'<rect class="stripe" x="{LEFT}" y="{y - ROW_H / 2:.1f}" '
                f'width="{PLOT_W}" height="{ROW_H}"/>'
            )
    return out


def _svg(
    processes: list[Process], faults: list[Fault], seconds: float, bucket: float | None
) -> tuple[str, dict[str, str], int, int]:
    times = [t for p in processes for t, _ in p.rate[:1] + p.rate[-1:]]
    times += [t for p in processes for t, _ in p.errors]
    times += [f.start for f in faults] + [f.end for f in faults if f.end is not None]
    t0 = min([0.0, *times])
    t1 = max([seconds, *times])
    if t1 - t0 < 1.0:
        t1 = t0 + 1.0
    peak = max((v for p in processes for _, v in p.rate), default=0.0)
    top, rates = rate_ticks(peak if peak > 0 else 1.0)
    n = len(processes)
    rows = 0 if n == 0 else (n if n <= MAX_ERROR_ROWS else 1)
    chart = Chart(t0, t1, top, rows)
    colours = _fault_colours(faults)
    marks, left_crosses, left_errors = _marks(chart, processes)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {chart.height}" '
        f'width="100%" role="img" aria-label="ids per second of each client over time">',
        # The stripes and grid first, the bands over them, the lines and errors on top.
        *_row_labels(chart, processes),
        *_axes(chart, time_ticks(t0, t1), rates),
        *_bands(chart, faults, colours),
        *_lines(chart, processes, bucket),
        *marks,
    ]
    if not any(p.rate for p in processes):
        parts.append(
            f'<text class="empty" x="{LEFT + PLOT_W / 2}" y="{TOP + PLOT_H / 2}">'
            "no rate samples</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts), colours, left_crosses, left_errors


# ---- the page ---------------------------------------------------------------------------------

CSS = (
    """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       margin: 1.5em auto; max-width: 1240px; padding: 0 1em; }
header { display: flex; align-items: center; gap: 1em; flex-wrap: wrap; }
h1 { margin: 0; font-size: 1.6em; }
h2 { font-size: 1.15em; margin: 1.6em 0 .5em; }
.meta { color: #555; margin: .2em 0 0; }
.verdict { font-size: 2.6em; font-weight: 800; padding: .05em .45em; border-radius: .2em;
           color: #fff; letter-spacing: .03em; }
.verdict.ok { background: #1a7f37; }
.verdict.fail { background: #d62728; }
.verdict.unknown { background: #888; }
.problems { border-left: 4px solid #d62728; background: #fff3f3; padding: .3em 1em;
            margin: 1em 0; }
.problems li { font-family: ui-monospace, monospace; white-space: pre-wrap; }
figure { margin: 1em 0; }
svg text { font-size: 11px; fill: #444; }
svg .grid { stroke: #e6e6e6; stroke-width: 1; }
svg .frame { fill: none; stroke: #bbb; }
svg .axis { stroke: #888; }
svg .stripe { fill: #f4f4f4; }
svg .ylabel, svg .rowlabel { text-anchor: end; }
svg .xlabel, svg .title, svg .empty { text-anchor: middle; }
svg .title { font-size: 12px; fill: #222; }
svg .empty { font-size: 16px; fill: #999; }
svg .band-label { font-weight: 600; }
svg .rate { fill: none; stroke-width: 1.4; stroke-linejoin: round; stroke-linecap: round; }
svg .rate:hover { stroke-width: 3; }
svg .error { stroke: #d62728; stroke-width: 1.6; fill: none; }
.legend { display: flex; flex-wrap: wrap; gap: .3em 1.4em; list-style: none; padding: 0;
          margin: .4em 0 0 """
    + str(round(LEFT / WIDTH * 100, 1))
    + """%; }
.legend svg { vertical-align: middle; }
.legend .sub { color: #777; }
.swatch { display: inline-block; width: .9em; height: .9em; border-radius: 2px;
          vertical-align: -.1em; }
.note { color: #a33; }
table { border-collapse: collapse; }
th, td { padding: .2em .7em; border-bottom: 1px solid #e4e4e4; text-align: left; }
th { background: #f6f6f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.over td { background: #fff0f0; }
.okay { color: #1a7f37; font-weight: 600; }
.bad { color: #d62728; font-weight: 700; }
"""
)


def _legend(entries: list[tuple[str, str, list[Process]]], kinds: dict[str, str]) -> str:
    items = []
    for colour, label, members in entries:
        errors = sum(len(p.errors) for p in members)
        samples = [v for p in members for _, v in p.rate]
        mean = sum(samples) / len(samples) if samples else 0.0
        sub = f"mean {fmt_rate(mean)} ids/s" + (f", {errors} errors" if errors else "")
        if len(members) == 1:
            sub = f"{members[0].strategy}, {sub}"
        items.append(
            f'<li><svg width="22" height="10"><line x1="0" y1="5" x2="22" y2="5" '
            f'stroke="{colour}" stroke-width="3"/></svg> {esc(label)} '
            f'<span class="sub">({esc(sub)})</span></li>'
        )
    for kind, colour in kinds.items():
        items.append(
            f'<li><span class="swatch" style="background:{colour};opacity:.45"></span> '
            f'{esc(kind)} <span class="sub">(fault)</span></li>'
        )
    return f'<ul class="legend">{"".join(items)}</ul>' if items else ""


def _fault_table(faults: list[Fault], colours: dict[str, str]) -> str:
    if not faults:
        return "<p>No faults.</p>"
    shown = faults
    if len(faults) > MAX_FAULT_ROWS:
        over = [f for f in faults if f.ok is False]
        rest = [f for f in faults if f.ok is not False][: max(0, MAX_FAULT_ROWS - len(over))]
        shown = sorted(over + rest, key=lambda f: f.start)
    rows = []
    for f in shown:
        verdict = {
            True: '<span class="okay">ok</span>',
            False: '<span class="bad">over</span>',
            None: DASH,
        }[f.ok]
        bound = DASH if f.bound is None else f"{f.bound:.2f} s"
        gap = DASH if f.longest_gap is None else f"{f.longest_gap:.2f} s"
        end = "(open)" if f.end is None else fmt_seconds(f.end)
        rows.append(
            f"<tr{' class=over' if f.ok is False else ''}>"
            f'<td><span class="swatch" style="background:{colours.get(f.kind, "#888")}"></span> '
            f"{esc(f.kind)}</td><td>{esc(f.target)}</td>"
            f'<td class="num">{fmt_seconds(f.start)}</td><td class="num">{end}</td>'
            f'<td class="num">{gap}</td><td class="num">{bound}</td><td>{verdict}</td></tr>'
        )
    note = ""
    if len(shown) < len(faults):
        note = f'<p class="note">{len(faults) - len(shown)} more faults within their bound.</p>'
    return (
        "<table><thead><tr><th>kind</th><th>target</th><th>start</th><th>end</th>"
        "<th>longest outage</th><th>bound</th><th>verdict</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{note}"
    )


def _count_table(summary: dict[str, Any], processes: list[Process], faults: list[Fault]) -> str:
    def row(label: str, value: object, bad: bool = False) -> str:
        cls = ' class="num bad"' if bad else ' class="num"'
        text = f"{value:,}" if isinstance(value, int) else str(value)
        return f"<tr><th>{esc(label)}</th><td{cls}>{esc(text)}</td></tr>"

    rows = []
    ids, repeated = summary.get("ids"), summary.get("repeated")
    rows.append(row("ids checked", ids if isinstance(ids, int) else DASH))
    if isinstance(repeated, int):
        rows.append(row("repeated", repeated, bad=repeated > 0))
    else:
        rows.append(row("repeated", DASH))
    rows.append(row("client processes", len(processes)))
    # The summary's own counts when it has them; counted from the timeline otherwise.
    by_kind = {str(k): v for k, v in _dict(summary.get("faults")).items()}
    if not by_kind:
        by_kind = dict(Counter(f.kind for f in faults))
    rows.append(row("faults", sum(v for v in by_kind.values() if isinstance(v, int))))
    rows.extend(row(f"faults: {kind}", n) for kind, n in sorted(by_kind.items()))
    over = sum(1 for f in faults if f.ok is False)
    rows.append(row("outages over their bound", over, bad=over > 0))
    errors = Counter(name for p in processes for _, name in p.errors)
    rows.append(row("client errors", sum(errors.values())))
    rows.extend(row(f"errors: {name}", n) for name, n in errors.most_common())
    return f"<table><tbody>{''.join(rows)}</tbody></table>"


def render_html(summary: dict[str, Any]) -> str:
    """The run's picture: one self-contained HTML page."""
    summary = _dict(summary)
    timeline = _dict(summary.get("timeline"))
    setup = str(summary.get("setup") or "torture run")
    seed = summary.get("seed")
    seconds = _float(summary.get("seconds")) or 0.0
    bucket = _float(timeline.get("bucket"))
    processes = _processes(timeline)
    # The outages carry everything the bands need and more; they replace the matching faults.
    outages = {_key(f): f for f in _faults(summary.get("outages"))}
    faults = [outages.pop(_key(f), f) for f in _faults(timeline.get("faults"))]
    faults = sorted(faults + list(outages.values()), key=lambda f: f.start)

    entries = _assign_colours(processes)
    svg, colours, left_crosses, left_errors = _svg(processes, faults, seconds, bucket)

    raw_verdict = str(summary.get("verdict") or "").strip()
    verdict, verdict_cls = {"ok": ("ok", "ok"), "fail": ("FAIL", "fail")}.get(
        raw_verdict.lower(), (raw_verdict or "no verdict", "unknown")
    )
    meta = [f"seed {seed}" if seed is not None else "no seed"]
    meta.append(f"{fmt_time(seconds)} ({seconds:g} s)" if seconds >= 120 else fmt_time(seconds))
    meta.append(f"{len(processes)} client process" + ("" if len(processes) == 1 else "es"))
    if isinstance(summary.get("ids"), int):
        meta.append(f"{summary['ids']:,} ids")
    problems = [str(p) for p in _list(summary.get("problems"))]

    page = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(verdict)}: {esc(setup)}, {esc(meta[0])}</title>",
        f"<style>{CSS}</style></head><body>",
        f'<header><div class="verdict {verdict_cls}">{esc(verdict)}</div>',
        f'<div><h1>{esc(setup)}</h1><p class="meta">{esc(" · ".join(meta))}</p></div></header>',
    ]
    if problems:
        items = "".join(f"<li>{esc(p)}</li>" for p in problems)
        page.append(f'<section class="problems"><h2>Problems</h2><ul>{items}</ul></section>')
    page.append(f'<figure class="chart">{svg}{_legend(entries, colours)}')
    if left_crosses:
        page.append(
            f'<p class="note">{left_crosses:,} error marks ({left_errors:,} errors) not drawn, '
            f"to keep the page light; the counts below include them.</p>"
        )
    page.append("</figure>")
    page.append(f"<h2>Faults</h2>{_fault_table(faults, colours)}")
    page.append(f"<h2>Counts</h2>{_count_table(summary, processes, faults)}")
    page.append("</body></html>")
    return "\n".join(page) + "\n"
