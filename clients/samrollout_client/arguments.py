"""Checks of the client's public arguments, made at the call: a wrong argument fails there with a message
that names what to pass, never later inside a request task.

`as_sampling` takes sampling settings as OpenAI users write them (a dict: ``{"max_tokens": 48,
"temperature": 1.0}``) as well as a `Sampling`; fields the server takes that `Sampling` does not
name go under ``extra``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from samrollout_client.protocol.modes import IN_FLIGHT_MODES
from samrollout_client.types import Prompt, Sampling, is_prompt

SamplingLike = Sampling | Mapping[str, Any] | None
"""What ``sampling=`` takes: a `Sampling`, a mapping of its fields (OpenAI's spelling), or None (the defaults)."""


def as_sampling(value: SamplingLike) -> Sampling:
    """``value`` as a `Sampling`; a mapping is read field by field (a ``stop`` string becomes a one-item list).

    Raises TypeError for anything else and ValueError for a mapping with a bad value or a field
    `Sampling` does not have (the message lists its fields; ``n`` is the call's own argument).
    """
    if value is None:
        return Sampling()
    if isinstance(value, Sampling):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"sampling must be a samrollout_client.Sampling or a dict of its fields, "
                        f"got {type(value).__name__}")
    fields = dict(value)
    if "n" in fields:
        raise ValueError("sampling has no 'n': pass the group size as generate(n=...) or "
                         "partial_rollout(group_size=...)")
    unknown = sorted(set(fields) - set(Sampling.model_fields))
    if unknown:
        raise ValueError(f"Sampling has no field {', '.join(map(repr, unknown))}; its fields are "
                         f"{', '.join(Sampling.model_fields)} (put other server fields in 'extra')")
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    try:
        return Sampling.model_validate(fields)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(f"bad Sampling field: {problems}") from None


def check_prompts(prompts: Sequence[Prompt]) -> None:
    """Refuse a bare string (a list of prompts is wanted) and any item that is not a prompt."""
    if isinstance(prompts, str | bytes):
        raise TypeError("prompts is a list of prompts: pass [prompt] for one")
    for index, prompt in enumerate(prompts):
        if not is_prompt(prompt):
            raise ValueError(f"prompt {index} must be a string or a non-empty list of token ids")


def check_prompt_stream(prompts: Iterable[Prompt]) -> None:
    """Refuse a bare string where an iterable of prompts is wanted (its items are checked as they are read)."""
    if isinstance(prompts, str | bytes):
        raise TypeError("prompts is an iterable of prompts: pass [prompt] for one")


def check_count(name: str, value: object, minimum: int = 1) -> None:
    """``value`` must be an int (not a bool) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def check_optional_text(name: str, value: object) -> None:
    """``value`` must be None or a non-empty string."""
    if value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"{name} must be a non-empty string or None, got {value!r}")


def check_update(version: object, in_flight: object) -> None:
    """A weight update's ``version`` (a non-empty string) and ``in_flight`` (one of `IN_FLIGHT_MODES`)."""
    if not isinstance(version, str) or not version:
        raise TypeError(f"version must be a non-empty string, got {version!r}")
    if in_flight not in IN_FLIGHT_MODES:
        raise ValueError(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
