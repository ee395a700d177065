"""Build vLLM engines with SAM speculation, from Python, without HTTP.

    from samrollout.engine import build_llm
    llm = build_llm("path/to/model", SpeculationConfig(k=3))

`engine_kwargs` is the piece the server and the tests share: vLLM keyword arguments
that load `SamProposer` through ``method="custom_class"`` and carry our config to the
worker processes in ``additional_config``.
"""

from __future__ import annotations

from typing import Any

from samrollout.config import ADDITIONAL_CONFIG_KEY, SpeculationConfig
from samrollout.spec_decode.schedule import SCHEDULE_FIELD, range_schedule, vllm_has_batch_size_schedule

PROPOSER_CLASS = "samrollout.spec_decode.proposer.SamProposer"


def engine_kwargs(model: str, speculation: SpeculationConfig | None = None, **overrides: Any) -> dict[str, Any]:
    """vLLM engine arguments for ``model``; ``speculation=None`` turns SAM off."""
    kwargs: dict[str, Any] = {"model": model}
    if speculation is not None:
        kwargs["speculative_config"] = vllm_speculative_config(speculation)
        additional = dict(overrides.pop("additional_config", None) or {})
        additional[ADDITIONAL_CONFIG_KEY] = speculation.to_json()
        kwargs["additional_config"] = additional
    kwargs.update(overrides)
    return kwargs


def vllm_speculative_config(speculation: SpeculationConfig) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for SAM: our proposer class and the largest draft; with the static
    threshold, also the draft range (or k up to the threshold) as vLLM's batch-size schedule where vLLM
    keeps one for ``custom_class`` (0.32) and no confident drafting past the threshold needs more."""
    config: dict[str, Any] = {"method": "custom_class", "model": PROPOSER_CLASS,
                              "num_speculative_tokens": speculation.largest_draft()}
    if (speculation.threshold_mode == "static" and not speculation.drafts_past_the_range()
            and vllm_has_batch_size_schedule()):
        config[SCHEDULE_FIELD] = range_schedule(speculation.effective_range())
    return config


def use_every_cpu_core() -> None:
    """On vLLM's CPU backend on a small machine, bind the worker's threads to every core, as the server does
    (`cpu_defaults.place_cpu_worker_threads`: vLLM's own binding leaves a 2-core machine's worker one core)."""
    from vllm.platforms import current_platform

    from samrollout.cpu_defaults import place_cpu_worker_threads

    if current_platform.is_cpu():
        place_cpu_worker_threads()


def build_llm(model: str, speculation: SpeculationConfig | None = None, **overrides: Any) -> Any:
    """An offline ``vllm.LLM`` with SAM speculation (call under ``if __name__ == "__main__":``)."""
    from vllm import LLM

    use_every_cpu_core()
    return LLM(**engine_kwargs(model, speculation, **overrides))


def build_async_engine(model: str, speculation: SpeculationConfig | None = None, **overrides: Any) -> Any:
    """A ``vllm.v1.engine.async_llm.AsyncLLM`` with SAM speculation (for servers)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    use_every_cpu_core()
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(model, speculation, **overrides)))
