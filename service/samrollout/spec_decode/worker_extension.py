"""Methods vLLM adds to its workers (``worker_extension_cls``): the server reaches the proposer, reloads weights.

The server calls them by name through ``engine.collective_rpc("samrollout_...")``: no
pickled callables cross the engine's IPC, and they work the same on CPU, CUDA and NPU
workers.  With speculation off they answer as if there were no drafter.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from samrollout.spec_decode.stats import ProposerStats

WORKER_EXTENSION_CLASS = "samrollout.spec_decode.worker_extension.SamWorkerExtension"


class SamWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's runner."""

    model_runner: Any
    vllm_config: Any

    def _samrollout_proposer(self) -> Any | None:
        from samrollout.spec_decode.proposer import SamProposer

        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        return drafter if isinstance(drafter, SamProposer) else None

    def samrollout_drafter_stats(self) -> dict[str, Any] | None:
        """The proposer's stats (`SamProposer.stats`) with whether the no-draft sampling patch is in place, as
        JSON for the trip to the server (`ProposerStats.to_json`; `ProposerStats.from_json` reads it); None when
        SAM is off."""
        from vllm.v1.sample import rejection_sampler

        proposer = self._samrollout_proposer()
        if proposer is None:
            return None
        patched = bool(getattr(rejection_sampler.rejection_sample, "__samrollout_patched__", False))
        stats: ProposerStats = replace(proposer.stats(), no_draft_sampling_patched=patched)
        return stats.to_json()

    def samrollout_reset_drafter(self) -> bool:
        """Forget every automaton and the gate's measurements; False when SAM is off."""
        proposer = self._samrollout_proposer()
        if proposer is None:
            return False
        proposer.reset()
        return True

    def samrollout_reload_weights(self, weights_path: str, clear_kv_cache: bool = True) -> None:
        """Load new weights from ``weights_path`` into the model in place (same architecture), then zero the KV cache
        unless told not to.

        The server loads weights only while generation is paused, between engine steps.
        ``clear_kv_cache``: True when no request owns a cache block any more (the update
        waited for them, aborted them, or, for ``continue``, preempted them, freeing their
        blocks); False for ``continue-keep-kv``, whose frozen requests keep their blocks and go
        on attending to them, and while the engine sleeps (the cache's memory is released then).

        vLLM's workers have ``reload_weights``; vllm-ascend 0.23's ``NPUWorker`` has not, but its
        runner inherits vLLM's ``GPUModelRunner.reload_weights``, which is called as vLLM's
        worker calls it (under the worker's config).
        """
        reload = getattr(self, "reload_weights", None)
        if callable(reload):
            reload(weights_path=weights_path)
        else:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):
                self.model_runner.reload_weights(weights_path=weights_path)
        if clear_kv_cache:
            self.samrollout_clear_kv_cache()

    def samrollout_clear_kv_cache(self) -> int:
        """Zero every KV-cache tensor of this worker; returns how many tensors were cleared.

        Attention reads whole cache blocks and masks the positions a request does not own; a
        NaN left in such a position by earlier (bad) weights survives the mask (0 x NaN is
        NaN) and poisons every later request placed in that block.  Zeroing the cache with
        every weight load makes a reload give exactly a fresh server's outputs.
        """
        import torch

        cleared = 0
        for cache in getattr(getattr(self, "model_runner", None), "kv_caches", None) or []:
            for tensor in cache if isinstance(cache, (list, tuple)) else [cache]:
                if isinstance(tensor, torch.Tensor):
                    tensor.zero_()
                    cleared += 1
        return cleared
