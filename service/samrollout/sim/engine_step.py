"""One simulated engine step on one instance, in phases: admit, verify, time, draft, finish, preempt.

The rule each phase follows is `samrollout.sim.rollout`'s (its module docstring): admission while a slot
is free and the KV budget holds the prompt; drafts verified against the recorded continuation; the step
timed by the cost table (decode/verify plus the prefill of what was admitted, plus the drafter's own CPU
time when charged); new tokens handed to the drafter; rows that reached their length finished; the newest
running sequence preempted while the KV cache exceeds the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from samrollout.replay.simulate import accepted_length
from samrollout.sim.cost import CostTable
from samrollout.sim.priors import FIT_EVERY_STEPS, fit_sample
from samrollout.sim.state import SimInstance, SimSequence, SimSettings


class StepAdmission(Protocol):
    """What a step needs of admission (`samrollout.sim.admission.Admission`)."""

    def release(self, instance: SimInstance) -> None:
        """Move the sequences the server admitted into the instance's engine queue."""
        ...

    def finished(self, instance: SimInstance, seq: SimSequence) -> None:
        """A sequence finished (or left the instance): the server learns its length."""
        ...


@dataclass
class EngineCounters:
    """What the engine steps did, summed over instances."""

    steps: int = 0
    decode_row_steps: int = 0
    drafting_row_steps: int = 0     # row-steps that verified a draft (vLLM's spec_decode_num_drafts)
    drafted: int = 0
    accepted: int = 0
    preemptions: int = 0
    drafter_s: float = 0.0
    step_cost_fit: list[dict[str, Any]] = field(default_factory=list)  # ours' step-cost fit, sampled (sim.priors)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per decoding row-step (accepted drafts plus the bonus token)."""
        return (self.decode_row_steps + self.accepted) / self.decode_row_steps if self.decode_row_steps else 0.0

    @property
    def drafted_acceptance_length(self) -> float:
        """Tokens per row-step that verified a draft (vLLM's mean acceptance length metric)."""
        return 1 + self.accepted / self.drafting_row_steps if self.drafting_row_steps else 1.0


def advance(instance: SimInstance, settings: SimSettings, cost: CostTable, admission: StepAdmission,
            counters: EngineCounters, version: int = 0) -> list[SimSequence]:
    """Run one engine step on ``instance`` (its clock moves on); the sequences it finished.

    ``version``: the weight version the step samples with (a sequence's first token records it).
    """
    admission.release(instance)
    if not instance.running and instance.waiting and instance.waiting[0].ready_s > instance.clock:
        instance.clock = instance.waiting[0].ready_s  # idle until a moved sequence arrives
    admitted, prefill_tokens = _admit(instance, settings)
    decoding = list(instance.running)
    step_tokens = _verify(decoding, counters)
    for seq in admitted:  # the prefill samples one token; a resumed sequence shows all it has
        seq.generated += 1
        seq.new_tokens = seq.truth[:seq.generated]
        if seq.first_version < 0:
            seq.first_version = version
    instance.running = decoding + admitted
    # The step's time passes before the drafter runs, as in vLLM (the proposer sees the step's sampled tokens
    # and the engine's clock after it), then the drafter's own time when it is charged.
    instance.clock += _step_seconds(cost, decoding, step_tokens, prefill_tokens)
    drafter_seconds = draft(instance)
    counters.drafter_s += drafter_seconds
    instance.clock += drafter_seconds * settings.drafter_time_scale if settings.charge_drafter else 0.0
    counters.steps += 1
    if counters.steps % FIT_EVERY_STEPS == 0 and decoding:
        sample = fit_sample(instance.drafter, cost, len(decoding), sum(s.context for s in decoding) / len(decoding),
                            instance.clock)
        if sample is not None:
            counters.step_cost_fit.append(sample)
    finished = _finish(instance, admission)
    _preempt(instance, settings.kv_tokens, counters)
    return finished


def _admit(instance: SimInstance, settings: SimSettings) -> tuple[list[SimSequence], int]:
    """Waiting sequences that enter this step (slots and KV budget allowing), and the tokens they prefill."""
    budget = settings.kv_tokens
    prefill_tokens = 0
    admitted: list[SimSequence] = []
    used = sum(seq.context for seq in instance.running)
    while instance.waiting and len(instance.running) + len(admitted) < settings.slots:
        seq = instance.waiting[0]
        if seq.ready_s > instance.clock:
            break
        if budget is not None and used + seq.context + 1 > budget and (instance.running or admitted):
            break
        instance.waiting.popleft()
        prefill_tokens += seq.context
        used += seq.context
        seq.admitted_at = instance.admissions
        if seq.started_s < 0:
            seq.started_s = instance.clock
        instance.admissions += 1
        admitted.append(seq)
    return admitted, prefill_tokens


def _verify(decoding: list[SimSequence], counters: EngineCounters) -> int:
    """Verify each decoding row's draft against its recorded tokens and advance it; the tokens the step verifies."""
    step_tokens = 0
    for seq in decoding:
        accepted = accepted_length(seq.draft, seq.truth, seq.generated, len(seq.draft))
        advance_by = min(accepted + 1, len(seq.truth) - seq.generated)
        counters.drafted += len(seq.draft)
        counters.drafting_row_steps += bool(seq.draft)
        counters.accepted += min(accepted, advance_by)
        counters.decode_row_steps += 1
        seq.row_steps += 1
        step_tokens += 1 + len(seq.draft)
        seq.new_tokens = seq.truth[seq.generated: seq.generated + advance_by]
        seq.generated += advance_by
    return step_tokens


def _step_seconds(cost: CostTable, decoding: list[SimSequence], step_tokens: int, prefill_tokens: int) -> float:
    """The step's time by the cost table: decode/verify of the running rows plus the prefill of those admitted."""
    if decoding:
        context = sum(seq.context for seq in decoding) / len(decoding)
        seconds = cost.step_seconds(len(decoding), step_tokens / len(decoding), context)
    else:
        seconds = cost.step_seconds(1, 1, float(prefill_tokens))
    return seconds + (cost.prefill_seconds(prefill_tokens, float(prefill_tokens)) if prefill_tokens else 0.0)


def _finish(instance: SimInstance, admission: StepAdmission) -> list[SimSequence]:
    """Take the rows that reached their length off the instance (drafter and admission told)."""
    finished = [seq for seq in instance.running if seq.done]
    for seq in finished:
        instance.running.remove(seq)
        seq.finish_s = instance.clock
        seq.in_drafter = False
        if instance.drafter is not None:
            instance.drafter.remove(seq.index)
        admission.finished(instance, seq)
    return finished


def _preempt(instance: SimInstance, budget: int | None, counters: EngineCounters) -> None:
    """vLLM's recompute preemption: the newest running sequence goes back to the queue while the KV cache
    (every running sequence's prompt and output) exceeds the budget."""
    while budget is not None and len(instance.running) > 1 and \
            sum(seq.context for seq in instance.running) > budget:
        victim = max(instance.running, key=lambda s: s.admitted_at)
        instance.running.remove(victim)
        victim.draft = []
        victim.in_drafter = False
        if instance.drafter is not None:
            instance.drafter.remove(victim.index)
        instance.waiting.appendleft(victim)
        counters.preemptions += 1


def draft(instance: SimInstance) -> float:
    """Hand every running row's new tokens to the drafter and keep its drafts; the drafter's CPU time."""
    rows = instance.running
    if instance.drafter is None or not rows:
        for seq in rows:
            seq.draft = []
        return 0.0
    ids = [seq.index for seq in rows]
    for seq in rows:
        if not seq.in_drafter:  # first step after (re)admission: start it in the drafter
            instance.drafter.add(seq.index, seq.group, seq.prompt)
            seq.in_drafter = True
    contexts = [seq.full[:seq.context] for seq in rows]  # views: no copy per step
    start = time.thread_time()  # CPU time: another process on the machine does not inflate the charge
    drafts = instance.drafter.step(ids, [seq.new_tokens for seq in rows], contexts, instance.k)
    elapsed = time.thread_time() - start
    for seq, proposed in zip(rows, drafts, strict=True):
        room = len(seq.truth) - seq.generated
        seq.draft = list(proposed[:instance.k]) if room > 0 and not seq.rerun else []
    return elapsed
