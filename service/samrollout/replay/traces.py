"""Loading rollout traces (JSONL, optionally gzip) into token-id groups for replay.

Each line is one response: ``prompt_ids``/``response_ids`` (pre-tokenized) or
``prompt``/``response`` text (tokenized with ``--tokenizer``), and a group key
(``prompt_id``, ``group_id`` or ``group``; else the prompt itself) that makes the
n responses to one prompt siblings.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from samrollout.tokens import Int32Array, as_token_array

GROUP_KEYS = ("prompt_id", "group_id", "group")


@dataclass
class TraceGroup:
    """The responses to one prompt."""

    key: str
    prompt: Int32Array
    responses: list[Int32Array] = field(default_factory=list)


class TraceError(ValueError):
    """A trace file that cannot be replayed (names the file and line)."""


def _open(path: Path) -> Any:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def load_traces(path: str | Path, tokenizer: str | None = None, max_groups: int | None = None) -> list[TraceGroup]:
    """Read a trace file into groups, in file order."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace file {path} does not exist")
    encode = _tokenizer(tokenizer) if tokenizer else None
    groups: dict[str, TraceGroup] = {}
    with _open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceError(f"{path}:{number}: not JSON ({error.msg})") from None
            prompt, response = _ids(record, encode, f"{path}:{number}")
            key = next((str(record[k]) for k in GROUP_KEYS if k in record), None) or str(prompt.tolist())
            if key not in groups:
                if max_groups is not None and len(groups) >= max_groups:
                    continue
                groups[key] = TraceGroup(key, prompt)
            groups[key].responses.append(response)
    if not groups:
        raise TraceError(f"{path} holds no traces")
    return list(groups.values())


def _ids(record: dict[str, Any], encode: Any, where: str) -> tuple[Int32Array, Int32Array]:
    if "prompt_ids" in record and "response_ids" in record:
        prompt, response = record["prompt_ids"], record["response_ids"]
        return as_token_array(prompt, "prompt_ids"), as_token_array(response, "response_ids")
    if "prompt" in record and "response" in record:
        if encode is None:
            raise TraceError(f"{where}: text traces need --tokenizer (a Hugging Face tokenizer path)")
        prompt, response = encode(record["prompt"]), encode(record["response"])
        return as_token_array(prompt, "prompt"), as_token_array(response, "response")
    raise TraceError(f"{where}: needs prompt_ids/response_ids or prompt/response fields")


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return lambda text: np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def vocab_size(groups: list[TraceGroup]) -> int:
    """Smallest vocabulary that holds every token of the traces."""
    top = max(int(max(g.prompt.max(initial=0), *(r.max(initial=0) for r in g.responses))) for g in groups)
    return top + 1
