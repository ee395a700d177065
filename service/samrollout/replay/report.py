"""Replay output: a table for people, JSON for machines, a PNG for a glance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from samrollout.replay.long_context import LongContextCost
from samrollout.replay.simulate import ReplayResult


def format_table(results: list[ReplayResult]) -> str:
    """One row per drafter: MAL (all steps and tail steps), acceptance rate, draft tokens per step, costs."""
    tail = results[0].tail_rows if results else 16
    header = (f"{'drafter':<14}{'MAL':>7}{f'MAL tail<={tail}':>14}{'accept':>9}{'draft/step':>12}"
              f"{'us/step':>11}{'us/token':>11}")
    lines = [header, "-" * len(header)]
    for r in results:
        d = r.as_dict()
        lines.append(
            f"{r.name:<14}{d['mean_acceptance_length']:>7.3f}{d['tail_mean_acceptance_length']:>14.3f}"
            f"{d['acceptance_rate']:>9.3f}"
            f"{d['draft_tokens_per_step']:>12.2f}{d['us_per_step']:>11.2f}{d['us_per_token']:>11.2f}"
        )
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


def write_json(path: str | Path, results: list[ReplayResult], costs: list[LongContextCost],
               meta: dict[str, Any]) -> None:
    """Everything measured, with the run's parameters."""
    payload = {
        "meta": meta,
        "drafters": [r.as_dict() for r in results],
        "long_context": [c.as_dict() for c in costs],
    }
    Path(path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def write_plot(path: str | Path, results: list[ReplayResult], costs: list[LongContextCost], title: str) -> None:
    """Bars of MAL and cost per drafter, and cost against context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if costs else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2))
    names = [r.name for r in results]
    palette = plt.get_cmap("tab10")
    colors = [palette(i % 10) for i in range(len(names))]
    axes[0].bar(names, [r.mean_acceptance_length for r in results], color=colors)
    axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].set_title("mean acceptance length (bonus incl.)")
    for i, r in enumerate(results):
        axes[0].text(i, r.mean_acceptance_length, f"{r.mean_acceptance_length:.2f}", ha="center", va="bottom")
    axes[1].bar(names, [r.us_per_step for r in results], color=colors)
    axes[1].set_yscale("log")
    axes[1].set_title("drafter cost, us per row-step (log)")
    if costs:
        for name in dict.fromkeys(c.drafter for c in costs):
            points = sorted((c.context_tokens, c.us_per_step) for c in costs if c.drafter == name)
            axes[2].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        axes[2].set_xscale("log", base=2)
        axes[2].set_yscale("log")
        axes[2].set_xlabel("context tokens")
        axes[2].set_title("cost per row-step at long context (us)")
        axes[2].legend(fontsize=8)
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
