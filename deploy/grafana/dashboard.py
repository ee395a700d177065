"""The samrollout Grafana dashboard, as one Python list of panels; run it to write the JSON.

``python deploy/grafana/dashboard.py`` writes ``deploy/grafana/dashboards/samrollout.json``
(Grafana dashboard JSON, schemaVersion 39), which Grafana loads through the file provider in
``deploy/grafana/provisioning/dashboards/samrollout.yml``, and the same bytes to the Helm
chart's copy, ``deploy/helm/samrollout/dashboards/samrollout.json`` (Helm reads no file outside
a chart; the chart ships it in a ConfigMap for Grafana's dashboard sidecar, and
``tests/test_helm_chart.py`` fails when the copy is stale).  ``deploy/render_panels.py`` draws
the same `PANELS` to a PNG straight from Prometheus, and the scrape test
(``tests/test_prometheus_scrape.py``) runs every query of `all_queries` against a real
Prometheus scraping a real server.

Plain dicts, not a dashboard library: grafanalib has been unmaintained since 2023, and
Grafana's foundation SDK is a heavy dependency for a dozen-odd panels whose JSON is a few
stable fields (type, targets, unit, gridPos).  The panel list below is the one source:
edit it, re-run this file, commit both.

Queries use only ``samrollout_*`` metric names and Grafana's built-in ``$__rate_interval``
(no template variables), so they run as they are against any Prometheus once that is
replaced by a window such as ``1m``.  Every series is aggregated over all scraped servers
unless its legend names ``{{instance}}``.  The datasource is referenced by the fixed uid
``prometheus`` (``deploy/grafana/provisioning/datasources/prometheus.yml``), not ``${DS}``,
so provisioning needs no import step.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "prometheus"}
OUTPUT = Path(__file__).resolve().parent / "dashboards" / "samrollout.json"
HELM_COPY = Path(__file__).resolve().parents[1] / "helm" / "samrollout" / "dashboards" / "samrollout.json"
DASHBOARD_UID = "samrollout"
SCHEMA_VERSION = 39
# Rollouts end minutes apart (one per RL step), so their histograms are read over a fixed,
# longer window than $__rate_interval: the quantiles are over the rollouts that ended in it.
ROLLOUT_WINDOW = "10m"
# Speculation runs only in rollouts' tails, so the headline stats read a few minutes, not one rate interval.
STAT_WINDOW = "5m"
GRID_WIDTH = 24

PanelKind = Literal["timeseries", "stat"]


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel and its Grafana legend format (``{{label}}`` placeholders)."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """One dashboard panel: what it shows, in which unit, and how it is drawn.

    ``unit`` is a Grafana unit id (``s``, ``percentunit``, ``reqps``, ``none``, or a custom
    ``suffix: ...``); ``width`` is in Grafana's 24-column grid; ``stacked`` stacks the series;
    ``show_name`` makes a stat panel show the series name (its legend) instead of its value;
    ``no_value`` is what a panel shows when its queries return nothing (an idle server: no NaN).
    """

    title: str
    unit: str
    queries: tuple[Query, ...]
    section: str
    kind: PanelKind = "timeseries"
    description: str = ""
    width: int = 8
    height: int = 8
    min: float | None = None
    max: float | None = None
    stacked: bool = False
    show_name: bool = False
    no_value: str = ""


def _rate(metric: str, window: str = "$__rate_interval") -> str:
    """``rate(metric[window])``."""
    return f"rate({metric}[{window}])"


def _positive(expr: str) -> str:
    """``expr`` where it is above 0, else nothing: a ratio over it is then empty (the panel's ``no_value``), not NaN."""
    return f"({expr} > 0)"


def _quantile(q: float, histogram: str, window: str = "$__rate_interval", legend: str = "") -> Query:
    """The ``q`` quantile of a histogram over all servers (legend ``p50``, ``p90``... unless given)."""
    expr = f"histogram_quantile({q}, sum by (le) ({_rate(histogram + '_bucket', window)}))"
    return Query(expr, legend or f"p{round(q * 100)}")


def _mean(histogram: str, window: str = "$__rate_interval", legend: str = "mean") -> Query:
    """The mean of a histogram's observations over ``window``, over all servers."""
    expr = f"sum({_rate(histogram + '_sum', window)}) / sum({_rate(histogram + '_count', window)})"
    return Query(expr, legend)


ACCEPTED = "samrollout_spec_decode_accepted_tokens_total"
DRAFTED = "samrollout_spec_decode_draft_tokens_total"
DRAFTS = "samrollout_spec_decode_drafts_total"
GENERATED = "samrollout_generated_tokens_total"
HISTORY_GROUPS = "samrollout_drafter_history_groups_total"
HISTORY_HITS = "samrollout_drafter_history_hit_groups_total"
ACTIVE_SHARE = "avg by (instance) (avg_over_time(samrollout_speculation_active[$__rate_interval]))"
TOKENS_BY_INSTANCE = f"sum by (instance) ({_rate(GENERATED)})"

PAUSE = "samrollout_weight_update_pause_seconds"
CONTINUED = "samrollout_continued_requests_total"
RECOMPUTED = "samrollout_recomputed_tokens_total"

SPECULATION = "Speculation"
SERVING = "Serving"
ROLLOUTS = "Rollouts"
UPDATES = "Weight updates"

PANELS: list[Panel] = [
    # --- at a glance ---
    Panel("Acceptance rate (5 min)", "percentunit", (
        Query(f"sum({_rate(ACCEPTED, STAT_WINDOW)}) / {_positive(f'sum({_rate(DRAFTED, STAT_WINDOW)})')}",
              "accepted / drafted"),
    ), SPECULATION, kind="stat", width=4, height=4, min=0, max=1, no_value="nothing drafted",
        description="Accepted draft tokens / draft tokens verified over the last 5 minutes, all servers."),
    Panel("Acceptance length (5 min)", "none", (
        Query(f"1 + sum({_rate(ACCEPTED, STAT_WINDOW)}) / {_positive(f'sum({_rate(DRAFTS, STAT_WINDOW)})')}",
              "tokens / verification"),
    ), SPECULATION, kind="stat", width=4, height=4, no_value="nothing drafted",
        description="Tokens per verification step over the last 5 minutes: 1 (the bonus token) + accepted draft "
                    "tokens per draft."),
    Panel("Output tokens/s (now)", "suffix: tok/s", (
        Query(f"sum({_rate(GENERATED)})", "tokens/s"),
    ), SERVING, kind="stat", width=4, height=4, no_value="no server"),
    Panel("Longest draft (k)", "none", (
        Query("max(samrollout_speculation_k)", "k"),
    ), SPECULATION, kind="stat", width=4, height=4, no_value="speculation off",
        description="The most draft tokens one request may get in a step; the adaptive policy picks each "
                    "request's draft length from 0 to k."),
    Panel("Active rollouts", "none", (
        Query("sum(samrollout_rollouts_active)", "rollouts"),
    ), ROLLOUTS, kind="stat", width=4, height=4, no_value="no server",
        description="Rollout ids with requests in flight."),
    Panel("Weight version", "none", (
        Query("max by (version) (samrollout_weight_version_info)", "{{version}}"),
    ), SERVING, kind="stat", width=4, height=4, show_name=True, no_value="no server",
        description="The served weight version (several names: servers differ)."),
    # --- speculation ---
    Panel("Acceptance length", "none", (
        Query(f"1 + sum({_rate(ACCEPTED)}) / sum({_rate(DRAFTS)})", "mean (1 + accepted / drafts)"),
        _quantile(0.5, "samrollout_spec_decode_acceptance_length"),
        _quantile(0.9, "samrollout_spec_decode_acceptance_length"),
    ), SPECULATION, min=1,
        description="Tokens per verification step, including the bonus token. Quantiles are of each engine "
                    "step's average over its drafts."),
    Panel("Acceptance rate", "percentunit", (
        Query(f"sum({_rate(ACCEPTED)}) / sum({_rate(DRAFTED)})", "over the rate interval"),
        Query("avg(samrollout_spec_decode_acceptance_rate)", "since start (avg of servers)"),
    ), SPECULATION, min=0, max=1, description="Accepted draft tokens / draft tokens verified."),
    Panel("Acceptance by draft position", "percentunit", (
        Query("sum by (position) (rate(samrollout_spec_decode_accepted_tokens_per_position_total[$__rate_interval]))"
              " / sum by (position) (rate(samrollout_spec_decode_draft_tokens_per_position_total"
              "[$__rate_interval]))", "position {{position}}"),
    ), SPECULATION, min=0, max=1,
        description="Accepted / drafted at each position of the draft (position 0 is the first drafted token)."),
    Panel("Acceptance rate by draft source", "percentunit", (
        Query("sum by (source) (rate(samrollout_drafter_source_accepted_tokens_total[$__rate_interval]))"
              " / sum by (source) (rate(samrollout_drafter_source_draft_tokens_total[$__rate_interval]))",
              "{{source}}"),
    ), SPECULATION, min=0, max=1,
        description="Accepted / drafted tokens by where the draft came from: the request's own automaton, its "
                    "group's (siblings and earlier rollouts), the global index (when on)."),
    Panel("Output tokens/s, speculation on vs off", "suffix: tok/s", (
        Query(f"sum({TOKENS_BY_INSTANCE} * on (instance) {ACTIVE_SHARE})", "speculation on"),
        Query(f"sum({TOKENS_BY_INSTANCE} * on (instance) (1 - {ACTIVE_SHARE}))", "speculation off"),
    ), SPECULATION, stacked=True,
        description="All output tokens/s, split by the share of scrapes in the interval whose last engine step "
                    "drafted (samrollout_speculation_active), per server."),
    Panel("Running requests vs speculation threshold", "none", (
        Query("sum by (instance) (samrollout_requests_running)", "running {{instance}}"),
        Query("max by (instance) (samrollout_speculation_threshold)", "threshold {{instance}}"),
        Query("sum by (instance) (samrollout_requests_waiting)", "waiting {{instance}}"),
        Query("sum by (instance) (samrollout_drafter_active_requests)", "drafter automata {{instance}}"),
    ), SPECULATION, min=0,
        description="Drafting runs while running requests are at or below the threshold: the rollout's tail."),
    Panel("Drafter time per engine step", "s", (
        _mean("samrollout_drafter_step_seconds"),
        _quantile(0.5, "samrollout_drafter_step_seconds"),
        _quantile(0.99, "samrollout_drafter_step_seconds"),
    ), SPECULATION, min=0, description="Proposer time per engine step (all rows of the batch)."),
    Panel("Cross-epoch history hit rate", "percentunit", (
        Query(f"sum({_rate(HISTORY_HITS, ROLLOUT_WINDOW)}) / sum({_rate(HISTORY_GROUPS, ROLLOUT_WINDOW)})",
              "all servers"),
        Query(f"sum by (instance) ({_rate(HISTORY_HITS, ROLLOUT_WINDOW)})"
              f" / sum by (instance) ({_rate(HISTORY_GROUPS, ROLLOUT_WINDOW)})", "{{instance}}"),
    ), SPECULATION, min=0, max=1,
        description=f"Groups whose prompt had earlier responses in the server's cross-epoch history / groups that "
                    f"arrived, over the last {ROLLOUT_WINDOW}: how often a prompt came back to the server that saw "
                    "it (history-affine placement keeps it there; near 0 with several servers otherwise)."),
    # --- serving ---
    Panel("Request latency", "s", (
        _quantile(0.5, "samrollout_request_latency_seconds"),
        _quantile(0.9, "samrollout_request_latency_seconds"),
        _quantile(0.99, "samrollout_request_latency_seconds"),
    ), SERVING, min=0, description="End-to-end latency of finished requests."),
    Panel("Time to first token", "s", (
        _quantile(0.5, "samrollout_time_to_first_token_seconds"),
        _quantile(0.9, "samrollout_time_to_first_token_seconds"),
        _quantile(0.99, "samrollout_time_to_first_token_seconds"),
    ), SERVING, min=0),
    Panel("Time per output token", "s", (
        _quantile(0.5, "samrollout_time_per_output_token_seconds"),
        _quantile(0.99, "samrollout_time_per_output_token_seconds"),
        _mean("samrollout_time_per_output_token_seconds"),
    ), SERVING, min=0, description="Mean time per output token of each finished request."),
    Panel("Request length", "none", (
        _mean("samrollout_request_prompt_tokens", legend="prompt mean"),
        _mean("samrollout_request_output_tokens", legend="output mean"),
        _quantile(0.99, "samrollout_request_output_tokens", legend="output p99"),
    ), SERVING, min=0, description="Prompt and output tokens of finished requests."),
    Panel("Finished requests/s by reason", "reqps", (
        Query("sum by (finish_reason) (rate(samrollout_requests_finished_total[$__rate_interval]))",
              "{{finish_reason}}"),
    ), SERVING, min=0, stacked=True),
    Panel("HTTP errors/s by code", "reqps", (
        Query("sum by (code) (rate(samrollout_http_errors_total[$__rate_interval]))", "{{code}}"),
    ), SERVING, min=0, stacked=True, description="Responses with an error status."),
    # --- rollouts ---
    Panel("Rollout tokens/s by source", "suffix: tok/s", (
        Query("sum by (source) (rate(samrollout_rollout_tokens_total[$__rate_interval]))", "{{source}}"),
    ), ROLLOUTS, stacked=True, width=6,
        description="Output tokens of rollout-tagged requests: from accepted drafts (draft), sampled by the model "
                    "(model), or not measured (n > 1)."),
    Panel("Rollout makespan", "s", (
        _quantile(0.5, "samrollout_rollout_makespan_seconds", ROLLOUT_WINDOW),
        _quantile(0.99, "samrollout_rollout_makespan_seconds", ROLLOUT_WINDOW),
        _mean("samrollout_rollout_tail_seconds", ROLLOUT_WINDOW, "tail (mean)"),
    ), ROLLOUTS, width=6, min=0,
        description=f"First request in to last response out, of the rollouts that ended in the last "
                    f"{ROLLOUT_WINDOW}; and the time they spent in their tail."),
    Panel("Rollout tail share", "percentunit", (
        _mean("samrollout_rollout_tail_share", ROLLOUT_WINDOW),
        _quantile(0.9, "samrollout_rollout_tail_share", ROLLOUT_WINDOW),
    ), ROLLOUTS, width=6, min=0, max=1,
        description=f"Tail time / makespan of the rollouts that ended in the last {ROLLOUT_WINDOW}: the tail is "
                    "the time at most `threshold` of a rollout's sequences were running."),
    Panel("Rollout longest / median response", "none", (
        _mean("samrollout_rollout_longest_to_median_ratio", ROLLOUT_WINDOW),
        _quantile(0.9, "samrollout_rollout_longest_to_median_ratio", ROLLOUT_WINDOW),
    ), ROLLOUTS, width=6, min=1,
        description=f"Longest / median response length (tokens) of the rollouts that ended in the last "
                    f"{ROLLOUT_WINDOW}."),
    Panel("Queue time", "s", (
        _quantile(0.5, "samrollout_scheduler_wait_seconds", legend="server wait p50"),
        _quantile(0.99, "samrollout_scheduler_wait_seconds", legend="server wait p99"),
        _quantile(0.5, "samrollout_engine_queue_seconds", legend="engine queue p50"),
        _quantile(0.99, "samrollout_engine_queue_seconds", legend="engine queue p99"),
    ), ROLLOUTS, width=12, min=0,
        description="Time a sequence waited for an engine slot: in the server under length-aware scheduling "
                    "(empty under fcfs), and in the engine's own queue."),
    Panel("Length prediction error", "percentunit", (
        _quantile(0.1, "samrollout_scheduler_length_prediction_error_ratio", legend="p10"),
        _quantile(0.5, "samrollout_scheduler_length_prediction_error_ratio", legend="p50"),
        _quantile(0.9, "samrollout_scheduler_length_prediction_error_ratio", legend="p90"),
    ), ROLLOUTS, width=12,
        description="(predicted - actual) / actual output length of the sequences length-aware scheduling "
                    "admitted by prediction (not the probes); empty under fcfs."),
    # --- weight updates: what each costs (RL steps are minutes apart, hence the rollout window) ---
    Panel("Update pause by mode", "s", (
        Query(f"sum by (in_flight) ({_rate(PAUSE + '_sum', ROLLOUT_WINDOW)})"
              f" / sum by (in_flight) ({_rate(PAUSE + '_count', ROLLOUT_WINDOW)})", "{{in_flight}} (mean)"),
    ), UPDATES, width=6, min=0,
        description=f"Seconds generation was held per weight update, by what the update did to requests in flight "
                    f"(wait includes draining them), over the last {ROLLOUT_WINDOW}."),
    Panel("Update share of wall time", "percentunit", (
        Query(f"sum by (instance) ({_rate(PAUSE + '_sum', ROLLOUT_WINDOW)})", "{{instance}}"),
    ), UPDATES, width=6, min=0, max=1,
        description=f"Share of the last {ROLLOUT_WINDOW} each server held generation for weight updates "
                    "(the recording rule samrollout:weight_update_share:rate10m)."),
    Panel("Sequences continued across updates", "none", (
        Query(f"sum(increase({CONTINUED}[{ROLLOUT_WINDOW}]))", f"all modes ({ROLLOUT_WINDOW})"),
        Query(f"sum by (in_flight) (increase({CONTINUED}[{ROLLOUT_WINDOW}]))", f"{{{{in_flight}}}} ({ROLLOUT_WINDOW})"),
    ), UPDATES, width=6, min=0,
        description=f"Sequences with tokens that weight updates carried onto new weights over the last "
                    f"{ROLLOUT_WINDOW}: all modes summed, and by mode (continue recomputes their KV, "
                    f"continue-keep-kv keeps it)."),
    Panel("Servers by weight version", "none", (
        Query("count by (version) (samrollout_weight_version_info)", "{{version}}"),
    ), UPDATES, width=6, min=0, stacked=True,
        description="How many servers serve each weight version: more than one line at once is a split (a push "
                    "that committed on some servers only; the client raises WeightsSplit naming them)."),
    Panel("Weight peers by state", "none", (
        Query("sum by (state) (samrollout_weight_peers)", "{{state}}"),
        Query("sum(samrollout_weight_peers_on_other_version)", "answering on another version"),
    ), UPDATES, width=6, min=0,
        description="Each server's configured weight peers as last probed (every 15 s): key_refused is a "
                    "configuration error (the servers were given different API keys: pushes go to those peers "
                    "directly, and they carry the whole checkpoint each)."),
    Panel("Tokens recomputed by updates", "none", (
        Query(f"sum(increase({RECOMPUTED}[{ROLLOUT_WINDOW}]))", f"recomputed ({ROLLOUT_WINDOW})"),
    ), UPDATES, width=6, min=0,
        description=f"Prompt and generated tokens that continue updates prefilled again (their KV computed under "
                    f"the new weights), over the last {ROLLOUT_WINDOW}; continue-keep-kv recomputes none."),
]


def all_queries() -> list[str]:
    """Every distinct PromQL expression of the panels, in panel order (``$__rate_interval`` left in)."""
    return list(dict.fromkeys(query.expr for panel in PANELS for query in panel.queries))


def _field_config(panel: Panel) -> dict[str, Any]:
    """Grafana's ``fieldConfig`` for a panel: unit, bounds, and the time series' line style."""
    defaults: dict[str, Any] = {"unit": panel.unit, "color": {"mode": "palette-classic"}}
    if panel.no_value:
        defaults["noValue"] = panel.no_value
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 25 if panel.stacked else 0,
            "showPoints": "never", "spanNulls": False,
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
        }
    else:
        defaults["color"] = {"mode": "fixed", "fixedColor": "text"}
    return {"defaults": defaults, "overrides": []}


def _options(panel: Panel) -> dict[str, Any]:
    """Grafana's panel ``options``: legend and tooltip for time series, reduction for stats."""
    if panel.kind == "timeseries":
        return {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
                "tooltip": {"mode": "multi", "sort": "desc"}}
    return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "name" if panel.show_name else "value", "colorMode": "none", "graphMode": "none",
            "justifyMode": "auto", "orientation": "auto", "wideLayout": True, "showPercentChange": False}


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    """One panel as Grafana JSON."""
    instant = panel.kind == "stat"  # a stat shows the current series only (not a version replaced an hour ago)
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": query.expr,
                "legendFormat": query.legend, "range": not instant, "instant": instant, "editorMode": "code"}
               for i, query in enumerate(panel.queries)]
    return {"id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
            "datasource": DATASOURCE, "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
            "fieldConfig": _field_config(panel), "options": _options(panel), "targets": targets}


def _row_json(title: str, panel_id: int, y: int) -> dict[str, Any]:
    """A (non-collapsed) row header."""
    return {"id": panel_id, "type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}}


def build_dashboard() -> dict[str, Any]:
    """The whole dashboard: the stat panels in one strip on top, then a row per section, laid out left to right."""
    panels: list[dict[str, Any]] = []
    next_id, x, y, row_height = 1, 0, 0, 0
    section: str | None = None
    for panel in PANELS:
        if panel.kind == "timeseries" and panel.section != section:
            section = panel.section
            y, x, row_height = y + row_height, 0, 0
            panels.append(_row_json(section, next_id, y))
            next_id, y = next_id + 1, y + 1
        if x + panel.width > GRID_WIDTH:
            y, x, row_height = y + row_height, 0, 0
        panels.append(_panel_json(panel, next_id, x, y))
        next_id, x, row_height = next_id + 1, x + panel.width, max(row_height, panel.height)
    return {
        "id": None, "uid": DASHBOARD_UID, "title": "samrollout", "description":
            "Rollout server: speculative decoding acceptance, serving latency, rollout makespan and tail. "
            "Generated by deploy/grafana/dashboard.py: edit that, not this JSON.",
        "tags": ["samrollout", "vllm", "speculative-decoding"], "timezone": "browser", "editable": True,
        "graphTooltip": 1, "fiscalYearStartMonth": 0, "liveNow": False, "links": [],
        "schemaVersion": SCHEMA_VERSION, "version": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"}, "timepicker": {},
        "templating": {"list": []},
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "panels": panels,
    }


def dashboard_json() -> str:
    """The dashboard as the exact text written to `OUTPUT` and `HELM_COPY`."""
    return json.dumps(build_dashboard(), indent=2) + "\n"


def main() -> int:
    """Write the dashboard JSON to the paths given as arguments, else to `OUTPUT` and `HELM_COPY`."""
    text = dashboard_json()
    for out in [Path(arg) for arg in sys.argv[1:]] or [OUTPUT, HELM_COPY]:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out} ({len(PANELS)} panels, {len(all_queries())} queries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
