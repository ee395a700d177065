"""Draw the samrollout Grafana dashboard's panels to one PNG, straight from a Prometheus server.

    python deploy/render_panels.py --prometheus http://127.0.0.1:9090 --minutes 10 --out panels.png

For whoever has a Prometheus but no Grafana: the panels are those of
``deploy/grafana/dashboard.py`` (its `PANELS`, imported by path, so the PNG and the dashboard
never drift apart), each query run through Prometheus's ``/api/v1/query_range`` over the last
``--minutes``, drawn in a matplotlib grid (Agg, no display): the stat panels in a strip on
top, then the time series.  Grafana's interval variables are replaced as Grafana would:
``$__interval`` by the query step, ``$__rate_interval`` by max(step + scrape interval,
4 x scrape interval), ``$__range`` by the whole window.

Exit status: 0 when every query ran (empty results included: they are drawn as "no data"),
1 when Prometheus rejected a query (the panel shows the error), 2 when it cannot be reached.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import matplotlib.dates as mdates
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, PercentFormatter

DASHBOARD_PY = Path(__file__).resolve().parent / "grafana" / "dashboard.py"
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
MAX_POINTS = 240  # points per series: the step is the window / this, at least one scrape interval


def load_dashboard(path: Path = DASHBOARD_PY) -> ModuleType:
    """Import ``deploy/grafana/dashboard.py`` by path (it is not part of an installed package)."""
    spec = importlib.util.spec_from_file_location("samrollout_dashboard", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Series:
    """One series of a query's result: its labels and values on the window's step grid.

    ``present`` marks the grid points with a sample: elsewhere ``values`` is NaN, and a NaN
    where ``present`` is true is Prometheus's own (0 / 0, e.g. acceptance with no drafts).
    """

    labels: dict[str, str]
    values: np.ndarray
    present: np.ndarray


@dataclass
class QueryResult:
    """What one panel query returned: its series, or the error Prometheus gave."""

    legend: str
    series: list[Series]
    error: str | None = None


@dataclass(frozen=True)
class Window:
    """The time range drawn and the values of Grafana's interval variables for it."""

    start: float
    end: float
    step: float
    rate_interval: float

    @property
    def times(self) -> np.ndarray:
        """The evaluation timestamps Prometheus uses: start, start + step, ... up to end."""
        count = math.floor((self.end - self.start) / self.step + 1e-9) + 1
        return self.start + self.step * np.arange(count)

    def substitute(self, expr: str) -> str:
        """``expr`` with Grafana's ``$__rate_interval``, ``$__interval`` and ``$__range`` replaced."""
        return (expr.replace("$__rate_interval", f"{round(self.rate_interval)}s")
                .replace("$__interval", f"{round(self.step)}s")
                .replace("$__range", f"{round(self.end - self.start)}s"))


def make_window(minutes: float, scrape_interval: float, end: float | None = None) -> Window:
    """The last ``minutes`` up to ``end`` (now), with Grafana's step and rate interval for it."""
    end = time.time() if end is None else end
    span = minutes * 60.0
    step = max(scrape_interval, math.ceil(span / MAX_POINTS))
    return Window(start=end - span, end=end, step=float(step),
                  rate_interval=max(step + scrape_interval, 4 * scrape_interval))


def query_range(client: httpx.Client, expr: str, window: Window) -> list[Series]:
    """Run ``expr`` over the window; raise `ValueError` with Prometheus's message if it rejects it."""
    reply = client.get("/api/v1/query_range", params={
        "query": window.substitute(expr), "start": window.start, "end": window.end, "step": window.step})
    try:
        body: dict[str, Any] = reply.json()
    except ValueError:
        reply.raise_for_status()
        raise
    if body.get("status") != "success":
        raise ValueError(f"{body.get('errorType', reply.status_code)}: {body.get('error', reply.text[:200])}")
    grid = window.times
    series = []
    for item in body["data"]["result"]:
        values, present = np.full(len(grid), np.nan), np.zeros(len(grid), dtype=bool)
        for timestamp, value in item["values"]:
            index = round((float(timestamp) - window.start) / window.step)
            if 0 <= index < len(grid):
                values[index], present[index] = float(value), True  # "NaN", "+Inf" parse too
        series.append(Series(labels=dict(item["metric"]), values=values, present=present))
    return series


def legend_text(legend: str, labels: dict[str, str]) -> str:
    """A Grafana legend format with its ``{{label}}`` placeholders filled in (empty when absent)."""
    text = LEGEND_LABEL.sub(lambda match: labels.get(match.group(1), ""), legend).strip()
    return text or "{" + ", ".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}"


def format_value(value: float, unit: str) -> str:
    """A value as the panel's Grafana unit would show it."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        magnitude = abs(value)
        if magnitude == 0:
            return "0 s"
        if magnitude < 1e-3:
            return f"{value * 1e6:.0f} µs"
        if magnitude < 1:
            return f"{value * 1e3:.3g} ms"
        if magnitude < 120:
            return f"{value:.3g} s"
        return f"{value / 60:.3g} min"
    if unit == "reqps":
        return f"{value:.3g} req/s"
    if unit.startswith("suffix:"):
        return f"{value:.4g}{unit.removeprefix('suffix:')}"
    return f"{value:.4g}"


def _axis_label(unit: str) -> str:
    """The y-axis label for units that are not spelled out on the ticks."""
    if unit == "reqps":
        return "req/s"
    if unit.startswith("suffix:"):
        return unit.removeprefix("suffix:").strip()
    return ""


MAX_LEGEND_ENTRIES = 12


def draw_timeseries(ax: Axes, panel: Any, results: list[QueryResult], window: Window) -> None:
    """One time-series panel: a line per series (stacked areas if the panel stacks), Grafana's legends."""
    x = mdates.date2num([datetime.fromtimestamp(t) for t in window.times])  # type: ignore[no-untyped-call]  # local
    everything = [series for result in results for series in result.series]
    # Stacks are drawn where at least one series has a sample; a missing one counts 0 there.
    stack_mask = np.zeros(len(x), dtype=bool)
    for series in everything:
        stack_mask |= series.present
    base = np.zeros(len(x))
    drawn = 0
    for result in results:
        for series in result.series:
            label = legend_text(result.legend, series.labels)
            if np.all(np.isnan(series.values)):
                continue
            if panel.stacked:
                top = base + np.nan_to_num(series.values, nan=0.0, posinf=0.0, neginf=0.0)
                (line,) = ax.plot(x, np.where(stack_mask, top, np.nan), linewidth=1.0, label=label)
                ax.fill_between(x, base, top, where=stack_mask, alpha=0.35, linewidth=0, color=line.get_color())
                base = top
            else:
                ax.plot(x, series.values, linewidth=1.2, label=label)
            drawn += 1
    errors = [result.error for result in results if result.error]
    if errors:
        ax.text(0.5, 0.5, "\n".join(errors)[:300], transform=ax.transAxes, ha="center", va="center",
                color="tab:red", fontsize=7, wrap=True)
    elif not drawn:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
    if panel.unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0))
    elif panel.unit == "s":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: format_value(value, "s")))
    ax.set_ylabel(_axis_label(panel.unit), fontsize=8)
    if drawn:
        bottom, top = ax.get_ylim()
        ax.set_ylim(bottom if panel.min is None else panel.min, top if panel.max is None else max(top, panel.max))
        if panel.max is not None and panel.unit == "percentunit":
            ax.set_ylim(top=panel.max * 1.05)
        if drawn <= MAX_LEGEND_ENTRIES:
            ax.legend(fontsize=7, loc="upper left", framealpha=0.6)
        else:  # a legend of every weight version ever served would cover the panel
            ax.text(0.01, 0.97, f"{drawn} series", transform=ax.transAxes, ha="left", va="top", fontsize=7)
    ax.set_xlim(x[0], x[-1])
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))  # type: ignore[no-untyped-call]
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)


def draw_stat(ax: Axes, panel: Any, results: list[QueryResult]) -> None:
    """One stat panel: each series' value at the window's end (or its name, for name panels) in large type.

    Like Grafana's instant query for the stat: a series gone before the end (a replaced
    weight version) is not shown.
    """
    lines = []
    for result in results:
        if result.error:
            lines.append(f"error: {result.error[:60]}")
        current = [series for series in result.series if len(series.present) and series.present[-1]]
        for series in current:
            if panel.show_name:
                lines.append(legend_text(result.legend, series.labels))
                continue
            value = format_value(float(series.values[-1]), panel.unit)
            lines.append(value if len(current) == 1 else f"{legend_text(result.legend, series.labels)}: {value}")
    text = "\n".join(lines) or getattr(panel, "no_value", "") or "no data"  # Grafana's noValue
    ax.text(0.5, 0.42, text, transform=ax.transAxes, ha="center", va="center",
            fontsize=18 if len(lines) <= 1 else 11, color="black" if lines else "grey")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_alpha(0.3)


def collect(client: httpx.Client, panels: list[Any], window: Window) -> list[list[QueryResult]]:
    """Every query of every panel over the window (a rejected query keeps its error, not the others')."""
    results = []
    for panel in panels:
        panel_results = []
        for query in panel.queries:
            try:
                panel_results.append(QueryResult(query.legend, query_range(client, query.expr, window)))
            except ValueError as error:
                panel_results.append(QueryResult(query.legend, [], str(error)))
        results.append(panel_results)
    return results


def render(panels: list[Any], results: list[list[QueryResult]], window: Window, out: Path, title: str,
           columns: int = 4) -> None:
    """Draw the panels to ``out`` (PNG): the stat panels in one strip, then the time series, ``columns`` wide."""
    stats = [(panel, result) for panel, result in zip(panels, results, strict=True) if panel.kind == "stat"]
    series = [(panel, result) for panel, result in zip(panels, results, strict=True) if panel.kind != "stat"]
    rows = math.ceil(len(series) / columns)
    stat_height = 1.3 if stats else 0.0
    figure = Figure(figsize=(6.0 * columns, stat_height + 3.4 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(rows + (1 if stats else 0), 1,
                               height_ratios=([stat_height] if stats else []) + [3.4] * rows)
    if stats:
        strip = grid[0].subgridspec(1, len(stats))
        for index, (panel, result) in enumerate(stats):
            ax = figure.add_subplot(strip[index])
            ax.set_title(panel.title, fontsize=9)
            draw_stat(ax, panel, result)
    body = grid[1 if stats else 0:].subgridspec(rows, columns) if rows else None
    for index, (panel, result) in enumerate(series):
        assert body is not None
        ax = figure.add_subplot(body[index // columns, index % columns])
        ax.set_title(f"{panel.section} · {panel.title}", fontsize=10)
        draw_timeseries(ax, panel, result, window)
    figure.suptitle(title, fontsize=12)
    figure.savefig(out, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--minutes", type=float, default=10.0, help="how far back to draw (default 10)")
    parser.add_argument("--end", type=float, help="the window's end, Unix seconds (default: now); the stat panels "
                        "show the values at that moment")
    parser.add_argument("--out", type=Path, default=Path("panels.png"), help="PNG to write (default panels.png)")
    parser.add_argument("--scrape-interval", type=float, default=5.0,
                        help="Prometheus's scrape interval in seconds, for $__rate_interval (default 5, as in "
                             "deploy/prometheus/prometheus.yml)")
    parser.add_argument("--columns", type=int, default=4, help="time-series panels per row (default 4)")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD_PY, help="the panel list (dashboard.py)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per Prometheus request")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Query, draw, write the PNG; print one line per panel (series found, errors)."""
    args = parse_args(argv)
    panels: list[Any] = load_dashboard(args.dashboard).PANELS
    window = make_window(args.minutes, args.scrape_interval, args.end)
    try:
        with httpx.Client(base_url=args.prometheus.rstrip("/"), timeout=args.timeout) as client:
            results = collect(client, panels, window)
    except httpx.HTTPError as error:
        print(f"cannot query Prometheus at {args.prometheus}: {error}", file=sys.stderr)
        return 2
    stamp = datetime.fromtimestamp(window.end).strftime("%Y-%m-%d %H:%M:%S")
    title = (f"samrollout — {args.prometheus} — last {args.minutes:g} min to {stamp} "
             f"(step {window.step:g}s, rate interval {window.rate_interval:g}s)")
    render(panels, results, window, args.out, title, columns=args.columns)
    failed = 0
    for panel, panel_results in zip(panels, results, strict=True):
        errors = [result.error for result in panel_results if result.error]
        failed += len(errors)
        count = sum(len(result.series) for result in panel_results)
        print(f"{panel.title:45s} {count:3d} series" + (f"  ERROR {'; '.join(errors)}" if errors else ""))
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
