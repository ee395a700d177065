"""The rejection-sampler patch: steps with drafts still go to vLLM; it is registered and applied once.

That its outputs equal vLLM's is checked on the real engine: the server's workers report the
patch active (test_server_metrics) and the exactness tests compare SAM on and off.
"""

from __future__ import annotations

import importlib.metadata

from vllm.v1.sample import rejection_sampler

from samrollout.spec_decode.no_draft_sampling import patch, without_draftless_work


def test_steps_with_drafts_go_to_vllms_function() -> None:
    calls: list[int] = []

    def fake(*args: object, **kwargs: object) -> str:
        calls.append(int(args[2]))  # type: ignore[call-overload]
        return "vllm"

    wrapped = without_draftless_work(fake)
    assert wrapped(None, [2, 0], 2, None, None, None, None, None) == "vllm" and calls == [2]


def test_plugin_is_registered_and_patches_vllm_once() -> None:
    names = {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "samrollout_no_draft_sampling" in names
    assert patch(rejection_sampler) and patch(rejection_sampler)
    assert getattr(rejection_sampler.rejection_sample, "__samrollout_patched__", False)
    assert getattr(rejection_sampler.apply_sampling_constraints, "__samrollout_patched__", False)
    assert not getattr(rejection_sampler.rejection_sample.__wrapped__, "__samrollout_patched__", False)
