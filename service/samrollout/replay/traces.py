"""Loading rollout traces (JSONL, optionally gzip) into token-id groups for replay.

Each line is one response: ``prompt_ids``/``response_ids`` (pre-tokenized) or
``prompt``/``response`` text (tokenized with ``--tokenizer``), and a group key
(``prompt_id``, ``group_id`` or ``group``; else the prompt itself) that makes the
n responses to one prompt siblings.  An optional ``meta`` object describes the
response; `is_clean` reads its ``finished`` and ``tail_loop`` fields, `select` filters
on them (and on any other meta field).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from samrollout.tokens import Int32Array, as_token_array

GROUP_KEYS = ("prompt_id", "group_id", "group")
ResponseFilter = Literal["clean", "all"]


@dataclass
class TraceGroup:
    """The responses to one prompt (``meta[i]`` describes ``responses[i]``; empty when the file has none)."""

    key: str
    prompt: Int32Array
    responses: list[Int32Array] = field(default_factory=list)
    meta: list[dict[str, Any]] = field(default_factory=list)

    def meta_of(self, index: int) -> dict[str, Any]:
        """The meta object of response ``index`` ({} when absent)."""
        return self.meta[index] if index < len(self.meta) else {}


class TraceError(ValueError):
    """A trace file that cannot be replayed (names the file and line)."""


def _open(path: Path) -> Any:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def split_paths(values: Iterable[str] | str | None) -> list[str]:
    """Trace paths from repeated and/or comma-separated ``--traces`` values, in order, without repeats."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            if part.strip() and part.strip() not in out:
                out.append(part.strip())
    return out


def load_traces(path: str | Path, tokenizer: str | None = None, max_groups: int | None = None) -> list[TraceGroup]:
    """Read a trace file into groups, in file order (``max_groups``: only the first N groups of the file)."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace file {path} does not exist")
    encode = _tokenizer(tokenizer) if tokenizer else None
    keys: list[str] = []
    records: list[tuple[str, dict[str, Any], str]] = []
    seen: set[str] = set()
    with _open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceError(f"{where}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{where}: each line must be a JSON object")
            _check_fields(record, encode, where)
            key = next((str(record[k]) for k in GROUP_KEYS if k in record), None)
            if key is None:
                key = str(record.get("prompt_ids", record.get("prompt")))
            if key not in seen:
                if max_groups is not None and len(seen) >= max_groups:
                    continue
                seen.add(key)
                keys.append(key)
            records.append((key, record, where))
    if not records:
        raise TraceError(f"{path} holds no traces")
    prompts, responses = _token_ids([r for _, r, _ in records], encode, [w for _, _, w in records])
    groups: dict[str, TraceGroup] = {}
    for (key, record, _), prompt, response in zip(records, prompts, responses, strict=True):
        group = groups.setdefault(key, TraceGroup(key, prompt))
        group.responses.append(response)
        meta = record.get("meta")
        group.meta.append(meta if isinstance(meta, dict) else {})
    return [groups[key] for key in keys]


def _check_fields(record: dict[str, Any], encode: Any, where: str) -> None:
    if "prompt_ids" in record and "response_ids" in record:
        return
    if "prompt" in record and "response" in record:
        if encode is None:
            raise TraceError(f"{where}: text traces need --tokenizer (a Hugging Face tokenizer path)")
        return
    raise TraceError(f"{where}: needs prompt_ids/response_ids or prompt/response fields")


def _token_ids(records: list[dict[str, Any]], encode: Any,
               where: list[str]) -> tuple[list[Int32Array], list[Int32Array]]:
    """Every record's prompt and response as int32 ids; text is tokenized in one batch per field."""
    texts = [i for i, r in enumerate(records) if not ("prompt_ids" in r and "response_ids" in r)]
    prompts: list[Any] = [r.get("prompt_ids") for r in records]
    responses: list[Any] = [r.get("response_ids") for r in records]
    if texts:
        # Identical prompts (a group's) are tokenized once.
        unique = list(dict.fromkeys(str(records[i]["prompt"]) for i in texts))
        encoded = dict(zip(unique, encode(unique), strict=True))
        for i, ids in zip(texts, encode([str(records[i]["response"]) for i in texts]), strict=True):
            prompts[i], responses[i] = encoded[str(records[i]["prompt"])], ids
    out_prompts, out_responses = [], []
    for prompt, response, place in zip(prompts, responses, where, strict=True):
        try:
            out_prompts.append(as_token_array(prompt, "prompt"))
            out_responses.append(as_token_array(response, "response"))
        except (TypeError, ValueError) as error:
            raise TraceError(f"{place}: {error}") from None
    return out_prompts, out_responses


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)

    def encode(texts: Sequence[str]) -> list[Int32Array]:
        ids = tok(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(row, dtype=np.int32) for row in ids]

    return encode


def is_clean(meta: dict[str, Any]) -> bool:
    """A response that ended on its own and did not loop: ``meta.finished`` and not ``meta.tail_loop``.

    A missing field does not disqualify: records without ``finished`` / ``tail_loop`` count as clean.
    """
    return bool(meta.get("finished", True)) and not bool(meta.get("tail_loop", False))


def parse_where(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for `select`: VALUE is read as JSON (true, 3, "x") where it parses, else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--where takes KEY=VALUE (a meta field), got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.strip(), parsed


def response_filters(choice: str) -> list[ResponseFilter]:
    """The response filters a ``--responses`` choice means: ``both`` is clean, then all; else the one named."""
    if choice == "both":
        return ["clean", "all"]
    if choice not in ("clean", "all"):
        raise ValueError(f"--responses must be clean, all or both, got {choice!r}")
    return [cast(ResponseFilter, choice)]


def select(groups: list[TraceGroup], responses: ResponseFilter = "all",
           where: Sequence[tuple[str, Any]] = ()) -> list[TraceGroup]:
    """The groups with only the responses that pass the filter; groups left with none are dropped.

    ``responses="clean"`` keeps `is_clean` responses; each ``(key, value)`` of ``where`` keeps
    responses whose ``meta[key] == value``.
    """
    if responses not in ("clean", "all"):
        raise ValueError(f"responses must be 'clean' or 'all', got {responses!r}")
    out = []
    for group in groups:
        keep = [i for i in range(len(group.responses))
                if (responses == "all" or is_clean(group.meta_of(i)))
                and all(group.meta_of(i).get(key) == value for key, value in where)]
        if keep:
            out.append(TraceGroup(group.key, group.prompt, [group.responses[i] for i in keep],
                                  [group.meta_of(i) for i in keep]))
    return out


def vocab_size(groups: list[TraceGroup]) -> int:
    """Smallest vocabulary that holds every token of the traces."""
    top = max(int(max(g.prompt.max(initial=0), *(r.max(initial=0) for r in g.responses))) for g in groups)
    return top + 1
