"""A record of what the proposer saw and drafted, step by step, to replay through a fresh `DraftSession`.

Set ``SAMROLLOUT_DRAFT_LOG=/path/file.jsonl`` in the engine's environment and every vLLM worker's
proposer appends one JSON line per step (the file gets a ``.{pid}`` suffix per worker process).  The
first line holds the session's config and settings; each step line holds its rows (with only the
tokens the log has not written for that request yet), the ids still in the batch, the clock and the
drafts returned.  `replay_draft_log` feeds the steps to a new session and returns both draft lists:
they are equal when the proposer is nothing but an adapter of the session.  For tests and debugging:
it writes every token, so leave it off in production.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from samrollout.config import SpeculationConfig
from samrollout.spec_decode.session import DraftSession, SessionSettings, StepRow

DRAFT_LOG_ENV = "SAMROLLOUT_DRAFT_LOG"


class DraftLogWriter:
    """Appends the proposer's steps to a JSONL file (see the module docstring)."""

    def __init__(self, path: str | Path, config: SpeculationConfig, vocab_size: int,
                 settings: SessionSettings) -> None:
        self._file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held for the proposer's life
        self._written: dict[Hashable, int] = {}  # tokens of each request already in the log
        self._line({"config": config.to_json(), "vocab_size": vocab_size, "settings": settings.as_dict()})

    @classmethod
    def from_env(cls, config: SpeculationConfig, vocab_size: int, settings: SessionSettings) -> DraftLogWriter | None:
        """A writer to ``$SAMROLLOUT_DRAFT_LOG.{pid}``, or None when the variable is unset."""
        path = os.environ.get(DRAFT_LOG_ENV)
        return cls(f"{path}.{os.getpid()}", config, vocab_size, settings) if path else None

    def write(self, rows: Sequence[StepRow], present: Sequence[Hashable], now: float,
              drafts: Sequence[Sequence[int]]) -> None:
        """One step: its rows, the ids in the batch, the clock and the drafts."""
        out = []
        for row in rows:
            start = self._written.get(row.request_id, 0)
            if start > row.length:
                start = 0  # the sequence shrank (preempted and resumed): write it again from the start
            out.append({"id": row.request_id, "sampled": row.sampled, "length": row.length,
                        "prompt_length": row.prompt_length, "group": row.group, "greedy": row.greedy,
                        "room": row.room, "seeded": row.seeded, "rollout": row.rollout, "start": start,
                        "tokens": np.asarray(row.tokens[start:row.length]).tolist()})
            self._written[row.request_id] = row.length
        live = set(present)
        for request_id in [r for r in self._written if r not in live]:
            del self._written[request_id]
        self._line({"rows": out, "present": list(present), "now": now, "drafts": [list(d) for d in drafts]})

    def _line(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


@dataclass(frozen=True)
class LoggedStep:
    """One step read back: the rows as the proposer built them, the ids present, the clock, the drafts."""

    rows: list[StepRow]
    present: list[Hashable]
    now: float
    drafts: list[list[int]]


def read_draft_log(path: str | Path) -> tuple[DraftSession, Iterator[LoggedStep]]:
    """A fresh session built as the logged proposer's was, and the logged steps in order."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    head = json.loads(lines[0])
    session = DraftSession(SpeculationConfig.from_json(head["config"]), int(head["vocab_size"]),
                           SessionSettings.from_dict(head["settings"]))

    def steps() -> Iterator[LoggedStep]:
        sequences: dict[Hashable, list[int]] = {}
        for line in lines[1:]:
            record = json.loads(line)
            rows = []
            for row in record["rows"]:
                tokens = sequences.get(row["id"], [])[:row["start"]] + row["tokens"]
                sequences[row["id"]] = tokens
                rows.append(StepRow(row["id"], row["sampled"], tokens, row["length"], row["prompt_length"],
                                    row["group"], row["greedy"], row["room"], row.get("seeded", False),
                                    row.get("rollout")))
            present = record["present"]
            live = set(present)
            for request_id in [r for r in sequences if r not in live]:
                del sequences[request_id]
            yield LoggedStep(rows, present, float(record["now"]), record["drafts"])

    return session, steps()


def replay_draft_log(path: str | Path) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Per logged step, (the drafts the proposer returned, the drafts a fresh session returns)."""
    session, steps = read_draft_log(path)
    return [(step.drafts, session.step(step.rows, step.present, now=step.now)) for step in steps]
