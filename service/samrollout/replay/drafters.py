"""Our drafters under replay: the native SAM (own and group) and the published pure-Python baseline."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from samrollout.drafter import DraftPolicy, SamDrafter
from samrollout.history import ResponseHistory, prompt_key


class SamReplayDrafter:
    """The native drafter; with ``group=True`` siblings of a prompt share a group automaton, and with a
    ``history`` earlier rollouts' responses to the prompt join the group (as the engine's proposer does)."""

    def __init__(self, name: str, vocab_size: int, policy: DraftPolicy | None = None, group: bool = False,
                 history: ResponseHistory | None = None, confident_match: int = 0) -> None:
        if history is not None and not group:
            raise ValueError("history joins group automata: it needs group=True")
        self.name = name
        self.group = group
        self.history = history
        self.confident_match = confident_match
        self.drafter = SamDrafter(vocab_size, policy)
        self._keys: dict[int, bytes] = {}

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Index the prompt (once per group in group mode; a new group takes the prompt's history)."""
        group = group_id if self.group else None
        new_group = group is not None and not self.drafter.has_group(group)
        self.drafter.add_request(seq_id, prompt, group=group)
        if self.history is not None:
            key = self._keys[seq_id] = prompt_key(prompt)
            if new_group:
                for response in self.history.responses(key):
                    self.drafter.add_to_group(group, response)

    def remember(self, group_id: int, prompt: np.ndarray, responses: Sequence[np.ndarray]) -> None:
        """An earlier rollout's responses to this prompt go to the history (nothing without one) and, with
        a global index, into it: a server that served that rollout indexed them as its requests finished."""
        if self.history is not None:
            key = prompt_key(prompt)
            for index, response in enumerate(responses):
                self.history.record(key, ("earlier", group_id, index), response)
        if self.drafter.policy.max_global_tokens:
            for response in responses:
                self.drafter.add_to_global(response)

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[int]]:
        """One batched native call: append accepted tokens, draft for every row."""
        return self.drafter.step(seq_ids, new_tokens, k)

    def confident(self, seq_ids: Sequence[int], drafts: Sequence[list[int]]) -> list[list[int]]:
        """In a round past the threshold, the drafts the engine still makes (`SpeculationConfig.confident_match`):
        those from a match of at least ``confident_match`` tokens (none when it is 0)."""
        if not self.confident_match:
            return [[] for _ in drafts]
        evidence = self.drafter.last_match_lengths(seq_ids)
        return [draft if match >= self.confident_match else [] for draft, match in zip(drafts, evidence, strict=True)]

    def remove(self, seq_id: int) -> None:
        """Free the sequence (and its group with its last member); its response joins the history."""
        if self.history is not None:
            self.history.record(self._keys.pop(seq_id), seq_id, self.drafter.response(seq_id))
        self.drafter.remove_request(seq_id)

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
