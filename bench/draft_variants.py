"""Drafting ideas measured against vLLM's suffix-cache on real traces: which ones raise the tail MAL?

    R=../shared/data/reasoning-traces
    python bench/draft_variants.py --traces $R/skyt1-ckpt-aime24.jsonl.gz,$R/r1distill-math-samples.jsonl.gz \\
        --tokenizer "$(samrollout model smollm2)" --json bench/results/draft-variants.json

Replays `sam-history` (our default drafter with an earlier rollout, ``--history``) at the tail draft
range (``--k``, 16) under the engine's threshold, with no drafts past it, beside `suffix-cache` at
the same k, and these variants of ours (each a wrapper around the native drafter, or a policy):

- ``frequent`` / ``frequent p=0.1``: `DraftPolicy(occurrence="frequent", min_probability=...)`.
- ``cut tau=T``: each draft is cut where the online estimate of the probability that all of it is
  accepted falls below T; the estimate is a table of conditional acceptance per draft position,
  keyed by the match length (log2 bucket) and the row's last outcome (no draft, rejected at once,
  partly or fully accepted), learned from the drafts that were verified.
- ``select(sam-history, suffix-cache)``: per row and step the draft of the source whose first
  token was right most often for drafts with the same evidence (match-length bucket for ours,
  draft length for suffix's), learned from every step: the appended tokens show whether each
  candidate's first token was right, verified or not.
- ``resync``: after a rejection at index j of a copy, the next draft resumes the copy past the
  deviating token (substitution: the rest of the last draft; deletion: past one more), while
  the automaton's own match is short.

Prints one table per trace file (tail MAL, its ratio to suffix-cache's, rejected per accepted
draft token, whole-rollout MAL) and writes every number to ``--json``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from harness import write_json
from samrollout.drafter import DraftPolicy
from samrollout.replay.command import split_history
from samrollout.replay.protocol import ReplayDrafter, remember
from samrollout.replay.registry import make_drafter
from samrollout.replay.simulate import ReplayResult, replay
from samrollout.replay.traces import load_traces, select, vocab_size


def _accepted_prefix(draft: Sequence[int], appended: Sequence[int]) -> int:
    """How many leading draft tokens the engine appended (at most all but the bonus token)."""
    n = 0
    for drafted, token in zip(draft, appended[:-1], strict=False):
        if int(drafted) != int(token):
            break
        n += 1
    return n


class _Wrapper:
    """Passes the replay protocol through to an inner SAM replay drafter, whose engine session gates the
    steps: past the threshold (confident drafts off here) every draft is dropped, and `_dropped` says so."""

    gates_itself = True

    def __init__(self, inner: Any, name: str) -> None:
        self.inner = inner
        self.name = name

    def configure(self, k: int | None, threshold: int | None) -> None:
        """The replay's gate and k, for the inner drafter's session."""
        self.inner.configure(k, threshold)

    @property
    def last_step_allowed(self) -> bool:
        """Whether the inner session's gate let the last step draft."""
        return bool(self.inner.last_step_allowed)

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[int]]:
        """The variant's drafts, or none at all in a step the engine's gate does not let draft."""
        drafts = self._variant_step(seq_ids, new_tokens, contexts, k)
        if self.inner.last_step_allowed:
            return drafts
        self._dropped(seq_ids)
        return [[] for _ in drafts]

    def _variant_step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
                      k: int) -> list[list[int]]:
        raise NotImplementedError

    def _dropped(self, seq_ids: Sequence[int]) -> None:
        """These rows' drafts were dropped by the gate: they were not verified (nothing to remember)."""

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Start a sequence in the inner drafter."""
        self.inner.add(seq_id, group_id, prompt)

    def remember(self, group_id: int, prompt: np.ndarray, responses: Sequence[np.ndarray]) -> None:
        """Hand an earlier rollout's responses to the inner drafter."""
        remember(self.inner, group_id, prompt, responses)

    def remove(self, seq_id: int) -> None:
        """Finish a sequence in the inner drafter."""
        self.inner.remove(seq_id)

    def _drafts_and_matches(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]],
                            contexts: Sequence[np.ndarray], k: int) -> tuple[list[list[int]], list[int]]:
        """The inner drafter's step, and the match length behind each row's draft."""
        drafts = self.inner.step(seq_ids, new_tokens, contexts, k)
        ids, proposal = self.inner.session.last_proposal or ([], None)
        matches = dict(zip(ids, proposal.match_lengths, strict=True)) if proposal is not None else {}
        return drafts, [matches.get(seq_id, 0) for seq_id in seq_ids]


class AcceptanceCut(_Wrapper):
    """Cuts drafts where the learned probability that all of the draft is accepted falls below ``tau``."""

    def __init__(self, inner: Any, tau: float) -> None:
        super().__init__(inner, f"cut tau={tau}")
        self.tau = tau
        self.verified: dict[int, tuple[list[int], tuple[int, int]]] = {}  # seq -> (verified draft, its key)
        self.outcome: dict[int, int] = {}
        self.table: dict[tuple[int, int], list[list[int]]] = {}  # key -> per position [accepted, tried]

    def remove(self, seq_id: int) -> None:
        """Forget the row."""
        super().remove(seq_id)
        self.verified.pop(seq_id, None)
        self.outcome.pop(seq_id, None)

    def _dropped(self, seq_ids: Sequence[int]) -> None:
        """Drafts dropped past the threshold were not verified, so they teach nothing."""
        for seq_id in seq_ids:
            if seq_id in self.verified:
                self.verified[seq_id] = ([], self.verified[seq_id][1])

    def _learn(self, seq_id: int, appended: list[int]) -> None:
        draft, key = self.verified.get(seq_id, ([], (0, 0)))
        if not draft:
            self.outcome[seq_id] = 0
            return
        accepted = _accepted_prefix(draft, appended)
        row = self.table.setdefault(key, [[0, 0] for _ in range(64)])
        for position in range(min(accepted + 1, len(draft))):
            row[position][1] += 1
            row[position][0] += position < accepted
        self.outcome[seq_id] = 1 if accepted == 0 else (3 if accepted == len(draft) else 2)

    def _variant_step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]],
                      contexts: Sequence[np.ndarray], k: int) -> list[list[int]]:
        """Learn from the last verified drafts, then draft and cut."""
        drafts, matches = self._drafts_and_matches(seq_ids, new_tokens, contexts, k)
        out = []
        for seq_id, appended, draft, match in zip(seq_ids, new_tokens, drafts, matches, strict=True):
            self._learn(seq_id, appended)
            key = (min(match, 1023).bit_length(), self.outcome.get(seq_id, 0))
            row = self.table.get(key)
            probability, keep = 1.0, 0
            for position in range(len(draft)):
                accepted, tried = row[position] if row else (0, 0)
                probability *= (accepted + 1) / (tried + 2)
                if probability < self.tau:
                    break
                keep += 1
            kept = list(draft[:keep])
            self.verified[seq_id] = (kept, key)
            out.append(kept)
        return out


class LearnedSelection(_Wrapper):
    """Our draft or suffix-cache's, whichever source's first token was right most often at that evidence."""

    def __init__(self, ours: Any, peer: ReplayDrafter) -> None:
        super().__init__(ours, "select(sam-history, suffix-cache)")
        self.peer = peer
        self.candidates: dict[int, list[tuple[int, list[int]]]] = {}
        self.hits: dict[tuple[int, int], list[int]] = {}  # (source, evidence) -> [right, tried]
        self.picked = [0, 0]

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Start the sequence in both sources."""
        super().add(seq_id, group_id, prompt)
        self.peer.add(seq_id, group_id, prompt)

    def remember(self, group_id: int, prompt: np.ndarray, responses: Sequence[np.ndarray]) -> None:
        """Both sources keep earlier rollouts."""
        super().remember(group_id, prompt, responses)
        remember(self.peer, group_id, prompt, responses)

    def remove(self, seq_id: int) -> None:
        """Finish the sequence in both sources."""
        super().remove(seq_id)
        self.peer.remove(seq_id)
        self.candidates.pop(seq_id, None)

    def _variant_step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]],
                      contexts: Sequence[np.ndarray], k: int) -> list[list[int]]:
        """Score the last candidates' first tokens, then pick per row."""
        ours, matches = self._drafts_and_matches(seq_ids, new_tokens, contexts, k)
        evidence = [min(m, 1023).bit_length() for m in matches]
        theirs = self.peer.step(seq_ids, new_tokens, contexts, k)
        out = []
        for row, (seq_id, appended) in enumerate(zip(seq_ids, new_tokens, strict=True)):
            for source, (bucket, draft) in enumerate(self.candidates.get(seq_id, [])):
                if draft and appended:
                    counts = self.hits.setdefault((source, bucket), [0, 0])
                    counts[1] += 1
                    counts[0] += int(draft[0]) == int(appended[0])
            candidates = [(evidence[row], list(ours[row])), (len(theirs[row]), list(theirs[row]))]
            self.candidates[seq_id] = candidates
            best: list[int] = []
            best_score, best_source = -1.0, -1
            for source, (bucket, draft) in enumerate(candidates):
                right, tried = self.hits.get((source, bucket), [0, 0])
                score = (right + 1) / (tried + 2)
                if draft and (score > best_score or (score == best_score and len(draft) > len(best))):
                    best, best_score, best_source = draft, score, source
            if best:
                self.picked[best_source] += 1
            out.append(best)
        return out


class Resync(_Wrapper):
    """After a rejected copy, resume it past the deviating token while the automaton's match is short."""

    def __init__(self, inner: Any, max_match: int, min_accepted: int) -> None:
        super().__init__(inner, f"resync match<{max_match} accepted>={min_accepted}")
        self.max_match = max_match
        self.min_accepted = min_accepted
        self.last: dict[int, list[int]] = {}

    def remove(self, seq_id: int) -> None:
        """Forget the row."""
        super().remove(seq_id)
        self.last.pop(seq_id, None)

    def _dropped(self, seq_ids: Sequence[int]) -> None:
        """Drafts dropped past the threshold are not the row's last verified draft."""
        for seq_id in seq_ids:
            self.last[seq_id] = []

    def _variant_step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]],
                      contexts: Sequence[np.ndarray], k: int) -> list[list[int]]:
        """Draft; where the last draft was rejected mid-copy and the match is short, resume the copy."""
        drafts, matches = self._drafts_and_matches(seq_ids, new_tokens, contexts, k)
        out = []
        for seq_id, appended, draft, match in zip(seq_ids, new_tokens, drafts, matches, strict=True):
            chosen = list(draft)
            last = self.last.get(seq_id)
            if last and appended and match < self.max_match:
                accepted = _accepted_prefix(last, appended)
                if accepted < len(last) and accepted >= self.min_accepted:
                    bonus = int(appended[-1])
                    deletion = accepted + 1 < len(last) and int(last[accepted + 1]) == bonus
                    rest = last[accepted + 2:] if deletion else last[accepted + 1:]
                    chosen = rest[:k] or chosen
            self.last[seq_id] = chosen
            out.append(chosen)
        return out


def variants(vocab: int, confident_match: int) -> list[tuple[str, Callable[[], Any]]]:
    """The variants, by name, each a fresh drafter per replay."""
    def sam(**policy: Any) -> Any:
        return make_drafter("sam-history", vocab, DraftPolicy(**policy).for_hardware(on_cpu=False), confident_match)

    return [
        ("sam-history (default)", sam),
        ("frequent", lambda: sam(occurrence="frequent")),
        ("frequent p=0.1", lambda: sam(occurrence="frequent", min_probability=0.1)),
        ("cut tau=0.05", lambda: AcceptanceCut(sam(), 0.05)),
        ("cut tau=0.1", lambda: AcceptanceCut(sam(), 0.1)),
        ("select(sam-history, suffix-cache)",
         lambda: LearnedSelection(sam(), make_drafter("suffix-cache", vocab))),
        ("resync", lambda: Resync(sam(), max_match=16, min_accepted=4)),
    ]


def _row(name: str, result: ReplayResult, reference: ReplayResult) -> dict[str, Any]:
    tail, ref_tail = result.tail_mean_acceptance_length, reference.tail_mean_acceptance_length
    return {"variant": name, "tail_mal": tail, "tail_vs_suffix_cache": tail / ref_tail if ref_tail else math.nan,
            "rejected_per_accepted": result.rejected_per_accepted, "mal": result.mean_acceptance_length,
            "acceptance_rate": result.acceptance_rate, "drafted": result.drafted, "accepted": result.accepted,
            "tail_steps": result.tail_steps}


def main() -> None:
    """Replay every variant on every file and print/write the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", required=True, help="comma-separated JSONL(.gz) trace files")
    parser.add_argument("--tokenizer", help="Hugging Face tokenizer path for text traces")
    parser.add_argument("--responses", choices=["clean", "all"], default="clean")
    parser.add_argument("--history", type=int, default=2, help="each group's first N responses: an earlier rollout")
    parser.add_argument("--k", type=int, default=16, help="draft tokens per step, ours and suffix-cache's")
    parser.add_argument("--threshold", type=int, default=8, help="ours draft only with at most this many running")
    parser.add_argument("--tail-rows", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    report: dict[str, Any] = {"options": vars(args), "files": []}
    for path in args.traces.split(","):
        start = time.perf_counter()
        loaded = load_traces(path, args.tokenizer)
        vocab = vocab_size(loaded)  # of every response: the earlier rollout's too
        groups, earlier = split_history(select(loaded, args.responses, []), args.history)
        reference = replay(make_drafter("suffix-cache", vocab), groups, args.k, args.tail_rows, None, earlier)
        rows = [_row("suffix-cache (every round)", reference, reference)]
        for name, build in variants(vocab, confident_match=0):
            result = replay(build(), groups, args.k, args.tail_rows, args.threshold, earlier)
            rows.append(_row(name, result, reference))
        print(f"\n== {path} ({args.responses}, --history {args.history}, k={args.k}; "
              f"{sum(len(g.responses) for g in groups)} responses replayed, {time.perf_counter() - start:.0f} s)")
        print(f"{'variant':<36}{'tail MAL':>9}{'vs suffix':>10}{'rej/acc':>9}{'MAL':>7}")
        for row in rows:
            print(f"{row['variant']:<36}{row['tail_mal']:>9.3f}{row['tail_vs_suffix_cache']:>9.3f}x"
                  f"{row['rejected_per_accepted']:>9.2f}{row['mal']:>7.3f}")
        report["files"].append({"traces": path, "rows": rows})
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
