"""Replay output: a table for people, JSON for machines, a PNG for a glance."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from samrollout.replay.long_context import LongContextCost
from samrollout.replay.simulate import ReplayResult

ORACLE_NOTE = ("* oracle, not a drafter (nothing can run it): at each step the best draft of its sources, "
               "picked by a verifier that knows the true continuation; the headroom of choosing between them")


@dataclass
class ReplayRun:
    """One trace file under one response filter: its counts and every drafter's (and the oracle's) result."""

    traces: str
    responses: str                  # "clean" or "all"
    groups: int
    responses_count: int
    response_tokens: int
    single_response_groups: int     # groups left with one response: they draft from their own text only
    results: list[ReplayResult] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # replay wall time per drafter
    note: str = ""                  # e.g. that --max-groups cut the file

    @property
    def label(self) -> str:
        """Short name for plots: file name and filter."""
        name = Path(self.traces).name.removesuffix(".gz").removesuffix(".jsonl")
        return f"{name} ({self.responses})"

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report (the oracle apart from the drafters)."""
        return {
            "traces": self.traces, "responses": self.responses, "groups": self.groups,
            "responses_count": self.responses_count, "response_tokens": self.response_tokens,
            "single_response_groups": self.single_response_groups, "note": self.note,
            "drafters": [r.as_dict() for r in self.results if not r.is_oracle],
            "oracle": [r.as_dict() | {"note": ORACLE_NOTE.removeprefix("* ")} for r in self.results if r.is_oracle],
            "replay_seconds": self.seconds,
        }


def _drafts_at(result: ReplayResult) -> str:
    return "always" if result.threshold is None else f"<={result.threshold} running"


def format_table(results: list[ReplayResult]) -> str:
    """One row per drafter (then the oracle, marked): k, when it drafts, MAL (all steps and tail steps),
    acceptance rate, rejected draft tokens per accepted one, draft tokens per step, costs."""
    tail = results[0].tail_rows if results else 8
    width = max([14] + [len(r.name) + 3 for r in results])
    header = (f"{'drafter':<{width}}{'k':>3}{'drafts at':>14}{'MAL':>7}{f'MAL tail<={tail}':>14}{'accept':>9}"
              f"{'rej/acc':>9}{'draft/step':>12}{'us/step':>11}{'us/token':>11}")
    lines = [header, "-" * len(header)]
    drafters = [r for r in results if not r.is_oracle]
    oracles = [r for r in results if r.is_oracle]
    for r in drafters + oracles:
        if r.is_oracle and r is oracles[0]:
            lines.append("-" * len(header))
        d = r.as_dict()
        name = f"{r.name}*" if r.is_oracle else r.name
        cost = (f"{'-':>11}{'-':>11}" if r.is_oracle else f"{d['us_per_step']:>11.2f}{d['us_per_token']:>11.2f}")
        tail_mal = f"{d['tail_mean_acceptance_length']:>14.3f}" if r.tail_steps else f"{'-':>14}"
        lines.append(
            f"{name:<{width}}{r.k:>3}{_drafts_at(r):>14}{d['mean_acceptance_length']:>7.3f}"
            f"{tail_mal}{d['acceptance_rate']:>9.3f}{d['rejected_per_accepted']:>9.2f}"
            f"{d['draft_tokens_per_step']:>12.2f}" + cost
        )
    if results and not results[0].tail_steps:
        lines.append(f"no tail: more than {tail} responses run to the last position (responses of equal, "
                     f"maximal length, such as ones cut at max_tokens)")
    never = [r for r in results if r.threshold is not None and not r.drafting_steps]
    if never:
        lines.append(f"{', '.join(r.name for r in never)}: never drafted: no round had at most "
                     f"{never[0].threshold} running responses (the engine's static threshold; see --threshold)")
    if oracles:
        lines.append(ORACLE_NOTE)
        for r in oracles:
            total = r.drafting_steps or 1
            wins = ", ".join(f"{name} {best / total:.0%} ({only / total:.0%} alone)"
                             for name, best, only in zip(r.sources, r.source_best, r.source_only_best, strict=True))
            lines.append(f"  {r.name}: drafting steps where each source gave the best draft (ties count for each): "
                         f"{wins}")
    return "\n".join(lines)


def format_long_context(costs: list[LongContextCost]) -> str:
    """Cost per step by context length, one row per drafter."""
    lengths = sorted({c.context_tokens for c in costs})
    names = list(dict.fromkeys(c.drafter for c in costs))
    header = f"{'drafter':<14}" + "".join(f"{f'us/step@{n // 1024}K':>14}" for n in lengths) + f"{'B/token':>10}"
    lines = [header, "-" * len(header)]
    for name in names:
        row = {c.context_tokens: c for c in costs if c.drafter == name}
        memory = row[lengths[-1]].bytes_per_token
        lines.append(
            f"{name:<14}" + "".join(f"{row[n].us_per_step:>14.2f}" for n in lengths)
            + (f"{memory:>10.0f}" if memory is not None else f"{'-':>10}")
        )
    return "\n".join(lines)


def write_json(path: str | Path, runs: list[ReplayRun], costs: list[LongContextCost], meta: dict[str, Any]) -> None:
    """Everything measured, with the run's parameters: one entry per trace file and response filter."""
    payload = {
        "meta": meta,
        "runs": [run.as_dict() for run in runs],
        "long_context": [c.as_dict() for c in costs],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def write_plot(path: str | Path, runs: list[ReplayRun], costs: list[LongContextCost], title: str) -> None:
    """Bars of MAL (all steps, tail) per drafter and run, drafter cost, and cost against context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(r.name for run in runs for r in run.results))
    oracle_names = {r.name for run in runs for r in run.results if r.is_oracle}
    panel_width = max(6.0, 0.22 * len(runs) * len(names) + 1.5)
    fig, grid = plt.subplots(2, 2, figsize=(2 * panel_width, 9.5))
    axes = grid.ravel()
    palette = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(names))
    x = np.arange(len(runs))
    for panel, (attr, label) in enumerate([("mean_acceptance_length", "MAL, all steps (bonus incl.)"),
                                           ("tail_mean_acceptance_length", "MAL in the tail")]):
        ax = axes[panel]
        for i, name in enumerate(names):
            values = [next((getattr(r, attr) for r in run.results if r.name == name), 0.0) for run in runs]
            ax.bar(x + (i - (len(names) - 1) / 2) * width, values, width, color=palette(i % 10),
                   hatch="//" if name in oracle_names else None, edgecolor="white" if name in oracle_names else None,
                   label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(x, [run.label for run in runs], rotation=20, ha="right", fontsize=8)
        ax.set_title(label if panel == 0 else f"{label} (<={runs[0].results[0].tail_rows} running)")
    axes[0].legend(fontsize=7)
    first = [r for r in runs[0].results if not r.is_oracle]
    axes[2].bar([r.name for r in first], [r.us_per_step for r in first],
                color=[palette(names.index(r.name) % 10) for r in first])
    axes[2].set_yscale("log")
    axes[2].set_title(f"drafter cost, us per row-step (log), {runs[0].label}", fontsize=9)
    axes[2].tick_params(axis="x", rotation=30)
    if costs:
        for name in dict.fromkeys(c.drafter for c in costs):
            points = sorted((c.context_tokens, c.us_per_step) for c in costs if c.drafter == name)
            axes[3].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        axes[3].set_xscale("log", base=2)
        axes[3].set_yscale("log")
        axes[3].set_xlabel("context tokens")
        axes[3].set_title("cost per row-step at long context (us)")
        axes[3].legend(fontsize=8)
    else:
        axes[3].set_axis_off()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
