"""Divided rollout: a long sample continues on a less loaded endpoint from what it has generated.

With ``AsyncRolloutClient(..., divide_after_tokens=C)`` and more than one endpoint, every
sample is streamed (with ``logprobs``: each token's own text tells whether a cut after it
is clean).  A sample moves when all of these hold after a streamed chunk:

- its current piece has generated at least ``C`` tokens (each move costs the new server a
  prefill of the prompt and the tokens so far, so each piece decodes at least ``C``);
- it has moved fewer than `MAX_MOVES` times for load;
- the chunk ends on a clean cut: its last token decodes on its own to whole characters (no
  U+FFFD), so no character is split between two servers' detokenizers;
- another up endpoint has room for it (`has_room`): none of this client's requests waits
  there (every one it was sent is streaming tokens), and either it streams at least
  `MOVE_MARGIN` fewer of this client's requests than the sample's endpoint does, or the
  sample's endpoint has requests waiting (it is full) and the other streams fewer than it
  (so, if the servers are alike, it has a free slot);
- that endpoint is known to serve the weight version of the sample's current piece (its last
  answer to this client or its ``/health`` said so; an endpoint not heard from yet takes no moves).

The one streaming the fewest is the target.  Only this client's requests are counted, as
for placement.  Room is judged from what is streaming, not from requests assigned: a
sample moved onto a server whose slots are full would only wait there, while the slot it
left goes to a request that was waiting anyway.

The client then closes the stream (the server sees the disconnect and aborts the request)
and sends ``prompt token ids + generated token ids`` to the target with ``max_tokens`` what
remains, the same ``group_id`` and ``rollout_id``.  The sample is the concatenation of its
pieces (token ids, text, logprobs); ``finish_reason``, ``weight_version`` and
``speculation`` are the last piece's (an abandoned piece's server never reports its
statistics); `Sample.pieces` lists where each piece ran, how many tokens it gave and under
which weight version.  `Sample.weight_version_spans` joins the pieces' spans, each shifted by
the tokens before it (`samrollout_client.spans`).  The server sends a choice's spans on the
chunk that ends it, which an abandoned piece never gets: its tokens count as its first
token's version (exact unless a weight update with ``in_flight: "continue"`` ran during that
piece).  On the servers, each abandoned piece ends as an aborted request
(rollout summaries and `report` count it as one more sequence, finished ``abort``).

Exactness: a greedy sample is the same as unmoved (its prefix is prefilled where it was
decoded; as with any change of batch, a backend whose kernels round differently by batch
shape can flip a near tie).  A seeded sample's first piece uses the seed as before; each
later piece uses `continuation_seed` (seed, tokens so far), so its draws are fresh rather
than a replay of the seed's random stream at new positions (correlated with the first
piece's draws).  A moved seeded sample is a valid sample of the model, but not the
bit-identical one an unmoved run of that seed gives.

If an endpoint fails mid-sample, the sample continues from its last clean cut on another
endpoint (tokens after that cut are generated again: the same for greedy).  Settings whose
meaning would change across a cut are refused (`check_divisible`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from samrollout_client.endpoints import Endpoint
from samrollout_client.placement import least_loaded
from samrollout_client.rollout_rules import MAX_MOVES, may_take_over
from samrollout_client.spans import join_spans, parse_spans
from samrollout_client.types import Sample, SamplePiece, Sampling, SpecStats, WeightVersionSpan

# Extra body fields whose meaning changes when generated tokens become prompt tokens.
_REFUSED_EXTRA = {
    "echo": "the continuation's echoed prompt would include the generated tokens",
    "presence_penalty": "vLLM applies it to generated tokens only, and a continuation's earlier tokens are prompt",
    "frequency_penalty": "vLLM applies it to generated tokens only, and a continuation's earlier tokens are prompt",
    "prompt_logprobs": "a continuation's prompt includes the generated tokens",
    "truncate_prompt_tokens": "it would cut the continuation's prompt (the generated tokens)",
    "stream": "the client streams divided samples itself",
}


def check_divide_after_tokens(value: int | None) -> None:
    """Raise ValueError unless ``value`` is None (off) or a positive int."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"divide_after_tokens must be None (off) or an integer >= 1, got {value!r}")


def check_divisible(sampling: Sampling) -> None:
    """Raise ValueError for sampling settings that cannot be divided exactly.

    ``stop`` strings: one could straddle a cut and go unseen by both servers.  The extra
    fields in ``_REFUSED_EXTRA`` change meaning when generated tokens become prompt tokens.
    (``stop_token_ids`` is fine: a token cannot straddle a cut; ``min_tokens`` is carried
    over as what remains of it.)
    """
    if sampling.stop:
        raise ValueError("divide_after_tokens cannot be combined with stop strings: a stop string could straddle "
                         "the point where a sample moves to another server (use stop_token_ids in extra, or turn "
                         "divide_after_tokens off)")
    for key, why in _REFUSED_EXTRA.items():
        if sampling.extra.get(key) not in (None, False, 0, 0.0):
            raise ValueError(f"divide_after_tokens cannot be combined with {key!r}: {why}")


def continuation_seed(seed: int, generated: int) -> int:
    """The seed of a piece that starts after ``generated`` tokens of a sample seeded ``seed`` (63 bits).

    Derived by hashing, so that it neither replays the first piece's random stream at new
    positions nor collides with the ``seed + i`` of sibling samples in practice.
    """
    digest = hashlib.blake2b(f"samrollout-continuation:{seed}:{generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def parse_event(line: str) -> dict[str, Any] | None:
    """The JSON payload of one SSE ``data:`` line (None for other lines and ``[DONE]``; `StreamError` if malformed)."""
    if not line.startswith("data: {"):
        return None
    try:
        payload: dict[str, Any] = json.loads(line[len("data: "):])
    except json.JSONDecodeError as error:
        raise StreamError({"message": f"a malformed event: {error}"}) from None
    return payload


@dataclass
class _Piece:
    """The part of a sample generated on one endpoint, as streamed so far."""

    endpoint: str
    weight_version: str | None = None
    tokens: int = 0       # tokens of this piece kept in the sample
    clean: bool = False   # the sample's last token ends on a clean cut
    spec: dict[str, Any] | None = None
    spans: list[dict[str, Any]] | None = None  # the server's weight_version_spans, from the chunk that ended it

    def version_spans(self) -> list[WeightVersionSpan]:
        """Which of this piece's tokens each version sampled (without the server's spans: its first token's)."""
        return parse_spans(self.spans, self.tokens, self.weight_version)


@dataclass
class DividedSample:
    """A sample being streamed in pieces: what it has generated, where, and where it may be cut."""

    max_tokens: int
    want_logprobs: bool
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    pieces: list[_Piece] = field(default_factory=list)
    load_moves: int = 0
    may_move: bool = True
    first_token_at: float | None = None  # time.monotonic() of its first token
    _clean: tuple[int, int, int] = (0, 0, 0)  # tokens, text length and logprobs at the last clean cut

    def start_piece(self, endpoint: str) -> None:
        """A request for the next piece goes to ``endpoint``."""
        self.pieces.append(_Piece(endpoint))

    def retract_piece(self) -> None:
        """The last piece's request was refused before any token came (a 429): it never was a piece."""
        self.pieces.pop()

    @property
    def piece(self) -> _Piece:
        """The piece being streamed."""
        return self.pieces[-1]

    @property
    def moves(self) -> int:
        """Continuations from generated tokens so far (pieces after the first)."""
        return max(0, len(self.pieces) - 1)

    def see(self, payload: dict[str, Any]) -> None:
        """Take in one streamed chunk (raises `StreamError` for an error event)."""
        if "error" in payload:
            raise StreamError(payload["error"])
        self.piece.weight_version = payload.get("weight_version", self.piece.weight_version)
        spec = (payload.get("metrics") or {}).get("speculative_decoding")
        if spec:
            self.piece.spec = spec
        for choice in payload.get("choices") or []:
            self._see_choice(choice)

    def _see_choice(self, choice: dict[str, Any]) -> None:
        if self.prompt_token_ids is None and choice.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(choice["prompt_token_ids"])
        ids = list(choice.get("token_ids") or [])
        if ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.token_ids += ids
        self.text += choice.get("text") or ""
        self.piece.tokens += len(ids)
        if choice.get("logprobs"):
            self.logprobs += choice["logprobs"].get("token_logprobs") or []
            strings = choice["logprobs"].get("tokens") or []
            if ids and len(strings) == len(ids):
                self.piece.clean = "\ufffd" not in strings[-1]
            elif ids:
                self.piece.clean = False
        elif ids:
            self.piece.clean = False
        if ids and self.piece.clean:
            self._clean = (len(self.token_ids), len(self.text), len(self.logprobs))
        if isinstance(choice.get("weight_version_spans"), list):
            self.piece.spans = choice["weight_version_spans"]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def movable(self, divide_after_tokens: int) -> bool:
        """Whether the sample may be cut here and moved for load (see the module docstring)."""
        return (self.may_move and self.finish_reason is None and self.load_moves < MAX_MOVES
                and self.prompt_token_ids is not None and self.piece.clean
                and self.piece.tokens >= divide_after_tokens and len(self.token_ids) < self.max_tokens)

    def cut_back(self) -> None:
        """Drop what came after the last clean cut (after a failure mid-piece); forget an empty piece."""
        tokens, text, logprobs = self._clean
        self.piece.tokens -= len(self.token_ids) - tokens
        del self.token_ids[tokens:], self.logprobs[logprobs:]
        self.text = self.text[:text]
        if self.piece.tokens <= 0:
            self.pieces.pop()

    def restart(self, may_move: bool) -> None:
        """Forget everything generated: the next request is the sample's original one."""
        self.token_ids, self.text, self.logprobs, self.pieces = [], "", [], []
        self.finish_reason, self._clean, self.may_move = None, (0, 0, 0), may_move

    def body(self, base: dict[str, Any], seed: int | None) -> dict[str, Any]:
        """The next piece's request: ``base`` at first, then a continuation from the tokens so far."""
        if not self.token_ids:
            return base
        assert self.prompt_token_ids is not None
        body = {**base, "prompt": self.prompt_token_ids + self.token_ids,
                "max_tokens": self.max_tokens - len(self.token_ids)}
        if seed is not None:
            body["seed"] = continuation_seed(seed, len(self.token_ids))
        if isinstance(base.get("min_tokens"), int):
            body["min_tokens"] = max(0, base["min_tokens"] - len(self.token_ids))
        return body

    def to_sample(self, endpoint: str, attempts: int) -> Sample:
        """The finished sample (its last piece's endpoint, finish reason, version and speculation)."""
        last = self.pieces[-1] if self.pieces else _Piece(endpoint)
        spec = last.spec
        spans = [p.version_spans() for p in self.pieces]
        return Sample(text=self.text, token_ids=self.token_ids, prompt_token_ids=self.prompt_token_ids,
                      logprobs=self.logprobs if self.want_logprobs else None, finish_reason=self.finish_reason,
                      weight_version=last.weight_version,
                      speculation=SpecStats(**{k: spec[k] for k in SpecStats.model_fields if k in spec})
                      if spec else None,
                      endpoint=endpoint, attempts=attempts, moves=self.moves,
                      pieces=[SamplePiece(endpoint=p.endpoint, tokens=p.tokens, weight_version=p.weight_version,
                                          weight_version_spans=piece_spans)
                              for p, piece_spans in zip(self.pieces, spans, strict=True)] if self.moves else [],
                      weight_version_spans=join_spans(
                          (p.tokens, piece_spans) for p, piece_spans in zip(self.pieces, spans, strict=True)))


class StreamError(Exception):
    """An error event inside a stream (the server failed after the response had started)."""

    def __init__(self, error: Any) -> None:
        details = error if isinstance(error, dict) else {"message": error}
        code = details.get("code")
        self.code = code if isinstance(code, int) else 500
        super().__init__(f"error in the stream ({self.code}): {details.get('message')}")


def move_target(current: Endpoint, endpoints: Sequence[Endpoint], sample: DividedSample,
                divide_after_tokens: int) -> Endpoint | None:
    """The endpoint ``sample`` should move to now, or None (the rule: the module docstring)."""
    if not sample.movable(divide_after_tokens):
        return None
    version = sample.piece.weight_version
    others = [e for e in endpoints if e is not current and not e.down and has_room(current, e)
              and version is not None and e.weight_version == version]
    return others[least_loaded([e.streaming for e in others])] if others else None


def has_room(source: Endpoint, target: Endpoint) -> bool:
    """Whether ``target`` can take over a sample streaming from ``source`` now (the module docstring)."""
    # Waiting: something of ours is queued there, or not started yet.
    return may_take_over(source.streaming, source.outstanding > source.streaming,
                         target.streaming, target.outstanding > target.streaming)


async def stream_piece(http: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any], sample: DividedSample,
                       endpoints: Sequence[Endpoint], divide_after_tokens: int,
                       on_status: Callable[[httpx.Response], None], hang_up_at: int | None = None) -> Endpoint | None:
    """Stream one piece of ``sample`` from ``endpoint``: the endpoint to move to, or None when the stream ended.

    Keeps the counts `move_target` reads: ``endpoint.streaming`` while the piece streams
    tokens, ``endpoint.outstanding`` lowered when it ends (its request was counted when
    sent), the target's raised when the sample moves.  A reply other than 200 is read and
    given to ``on_status``, which raises.  ``hang_up_at``: end the piece once the sample
    has that many tokens (benchmarks that enforce lengths the server cannot read).
    Connection errors (httpx) and error events (`StreamError`) propagate.
    """
    streaming = False
    try:
        async with http.stream("POST", f"{endpoint.url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                on_status(reply)
            async for line in reply.aiter_lines():
                payload = parse_event(line)
                if payload is None:
                    continue
                sample.see(payload)
                endpoint.weight_version = sample.piece.weight_version or endpoint.weight_version
                if not streaming and sample.piece.tokens:
                    streaming, endpoint.streaming = True, endpoint.streaming + 1
                if hang_up_at is not None and len(sample.token_ids) >= hang_up_at:
                    return None
                target = move_target(endpoint, endpoints, sample, divide_after_tokens)
                if target is not None:
                    target.outstanding += 1
                    return target
        return None
    finally:
        endpoint.outstanding -= 1
        if streaming:
            endpoint.streaming -= 1
