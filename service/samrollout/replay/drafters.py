"""Our drafters under replay: the native SAM (own and group) and the published pure-Python baseline."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from samrollout._core import MAX_DRAFT_TOKENS
from samrollout.config import SpeculationConfig
from samrollout.drafter import DraftPolicy, SamDrafter
from samrollout.spec_decode.schedule import dense_from_range
from samrollout.spec_decode.session import DraftSession, SessionSettings, StepRow


class SamReplayDrafter:
    """Ours under replay: the engine's own `DraftSession`, fed the replayed rows as vLLM's batch would be.

    ``group``: siblings of a prompt share a group automaton; ``history_tokens`` > 0: earlier rollouts'
    responses to the prompt join the group (cross-epoch history, needs ``group``); past the threshold
    (`configure`) rows whose match is ``confident_match``+ tokens still draft; ``draft_range``: the
    engine's draft length by batch size.  The session gates itself, so the replay must not drop its
    drafts (``gates_itself``).
    """

    gates_itself = True

    def __init__(self, name: str, vocab_size: int, policy: DraftPolicy | None = None, group: bool = False,
                 history_tokens: int = 0, confident_match: int = 0,
                 draft_range: tuple[tuple[int, int], ...] | None = None,
                 engine: SpeculationConfig | None = None, on_cpu: bool = False) -> None:
        if history_tokens and not group:
            raise ValueError("history joins group automata: it needs group=True")
        self.name = name
        self.vocab_size = vocab_size
        self.policy = policy or DraftPolicy()
        self.group = group
        self.history_tokens = history_tokens
        self.confident_match = confident_match
        self.draft_range = draft_range
        self.engine = engine
        self.on_cpu = on_cpu
        self.clock: Callable[[], float] | None = None  # the simulated clock, for the adaptive gate
        self.configure(None, None)
        self._rows: dict[int, tuple[str | None, int]] = {}  # live sequence -> (group, prompt length)

    @classmethod
    def as_engine(cls, name: str, vocab_size: int, config: SpeculationConfig, on_cpu: bool = False
                  ) -> SamReplayDrafter:
        """Ours exactly as an engine with this config drafts (its gate, draft range, confident drafts,
        history and policy, "auto" settled for ``on_cpu``); the replay's k and threshold do not apply."""
        return cls(name, vocab_size, config.policy, config.group_drafting, config.history_tokens,
                   config.confident_match, config.draft_range, engine=config, on_cpu=on_cpu)

    def configure(self, k: int | None, threshold: int | None) -> None:
        """Start afresh with the engine's gate at ``threshold`` running rows (None: draft in every round)
        and ``k`` as the largest draft (None: whatever each step asks); the replay calls this first."""
        if self.engine is not None:  # as the engine's proposer builds its session (SamProposer)
            engine = self.engine
            static_range = engine.threshold_mode == "static" and engine.draft_range is not None
            engine_schedule = (tuple(dense_from_range(engine.draft_range))
                               if static_range and engine.draft_range else None)
            self.session = DraftSession(engine, self.vocab_size, SessionSettings(
                largest_draft=engine.largest_draft(), confident_k=engine.k, on_cpu=self.on_cpu,
                schedule=engine_schedule))
            self.drafter = self.session.drafter
            return
        largest = k if k is not None else MAX_DRAFT_TOKENS
        config = SpeculationConfig(
            k=min(largest, 16), threshold_mode="off" if threshold is None else "static",
            threshold=threshold or SpeculationConfig.threshold, group_drafting=self.group, policy=self.policy,
            draft_range=self.draft_range, history_tokens=self.history_tokens,
            confident_match=self.confident_match if threshold is not None else 0)
        schedule = dense_from_range(config.draft_range) if config.draft_range is not None and threshold else None
        self.session = DraftSession(config, self.vocab_size, SessionSettings(
            largest_draft=largest, confident_k=largest, schedule=None if schedule is None else tuple(schedule)))
        self.drafter = self.session.drafter

    @property
    def last_step_allowed(self) -> bool:
        """Whether the gate let the last step draft (past the threshold only confident drafts are made)."""
        return self.session.last_step_allowed

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Start a sequence: its prompt is indexed at its first step, as the engine's proposer does."""
        self._rows[seq_id] = (f"group-{group_id}", len(prompt))

    def remember(self, group_id: int, prompt: np.ndarray, responses: Sequence[np.ndarray]) -> None:
        """An earlier rollout's responses to this prompt: into the history and (when on) the global index,
        as a server that served that rollout holds them."""
        self.session.remember(prompt, responses, [("earlier", group_id, i) for i in range(len(responses))])

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[int]]:
        """One engine step over these rows (every live sequence): the session indexes, gates and drafts."""
        rows = [StepRow(seq_id, len(tokens), context, len(context), self._rows[seq_id][1], self._rows[seq_id][0])
                for seq_id, tokens, context in zip(seq_ids, new_tokens, contexts, strict=True)]
        if self.engine is not None:
            return self.session.step(rows, self._rows, now=self.clock() if self.clock else None)
        return self.session.step(rows, self._rows, k=k)

    def remove(self, seq_id: int) -> None:
        """Free the sequence (and its group with its last member); its response joins the history."""
        del self._rows[seq_id]
        self.session.finish(seq_id)

    def memory_bytes(self) -> int:
        """Bytes held by the automata now."""
        return self.drafter.memory_bytes()


class _PySam:
    """A suffix automaton in pure Python, as the published recipe builds it (dict transitions)."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.first = [-1]
        self.last = 0
        self.tokens: list[int] = []

    def extend(self, token: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(token)
        cur = len(self.next)
        self.next.append({})
        self.link.append(0)
        self.length.append(self.length[self.last] + 1)
        self.first.append(pos)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = len(self.next)
                self.next.append(dict(self.next[q]))
                self.link.append(self.link[q])
                self.length.append(self.length[p] + 1)
                self.first.append(self.first[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur

    def draft(self, k: int) -> list[int]:
        match = self.link[self.last] if self.last else 0
        if match <= 0:
            return []
        start = self.first[match] + 1
        return self.tokens[start: min(start + k, len(self.tokens))]


class SamRefDrafter:
    """The published design (seed): one pure-Python SAM per request, first occurrence, k fixed, no group."""

    name = "sam-ref"

    def __init__(self) -> None:
        self.automata: dict[int, _PySam] = {}

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Build the request's automaton over its prompt, token by token."""
        sam = _PySam()
        for token in prompt.tolist():
            sam.extend(token)
        self.automata[seq_id] = sam

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[int]]:
        """Extend each row's automaton and draft the k tokens after the first occurrence."""
        drafts = []
        for seq_id, tokens in zip(seq_ids, new_tokens, strict=True):
            sam = self.automata[seq_id]
            for token in tokens:
                sam.extend(token)
            drafts.append(sam.draft(k))
        return drafts

    def remove(self, seq_id: int) -> None:
        """Drop the request's automaton."""
        del self.automata[seq_id]


class SamGoodputReplayDrafter:
    """Ours under replay as the adaptive policy chooses (`SamDrafter.step_goodput`), at equal k: every row's
    candidates (own, group and global copies; with ``proposals="counted"`` also the counted paths) are scored
    online against the tokens the row got, and each row drafts its candidate expected to be accepted longest.
    The step cost is flat (the replay has no step times), so every row drafts all of its chosen candidate up to
    k: what this measures is the choice between candidates, not the lengths a cost would cut."""

    def __init__(self, name: str, vocab_size: int, policy: DraftPolicy | None = None) -> None:
        self.name = name
        self.policy = (policy or DraftPolicy()).for_hardware(on_cpu=False)
        self.drafter = SamDrafter(vocab_size, self.policy)

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Start a sequence in its prompt's group (indexed at once: the engine indexes it at its first step)."""
        self.drafter.add_request(seq_id, prompt, group=f"group-{group_id}")

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[int]]:
        """One adaptive step at a flat cost: append, score the last candidates, draft each row's best."""
        rows = len(seq_ids)
        if not rows:
            return []
        chosen = self.drafter.step_goodput(seq_ids, new_tokens, k, np.ones(rows, dtype=np.uint8),
                                           np.full(rows, k, dtype=np.int32), np.ones(rows),
                                           np.ones(rows * k + 1))
        return [chosen.drafts[i, :chosen.lengths[i]].tolist() for i in range(rows)]

    def remove(self, seq_id: int) -> None:
        """Free the sequence (and its group with its last member)."""
        self.drafter.remove_request(seq_id)

    def memory_bytes(self) -> int:
        """Bytes held by the automata now."""
        return self.drafter.memory_bytes()
