"""Run a held engine a counted number of steps, then hold it again (a vLLM general plugin).

``/admin/pause`` "keep" stops vLLM's scheduler at a step boundary, and ``/admin/resume`` lets it
run on, but nothing in vLLM resumes it for a given number of steps: whoever wants to act a few
tokens into a generation (an operator reproducing a fault mid-response, a test landing a weight
update mid-request) has to resume, wait and pause again from outside, and on a loaded machine the
API process can take longer to send the pause than the engine takes to finish the requests.

This plugin adds one utility method to vLLM's engine core, `run_steps`, that the server calls
through vLLM's utility channel (``POST /admin/step``): the scheduler is unpaused, and after
``steps`` steps that ran the model (or once nothing is left to run) it is paused again with
vLLM's own "keep" state, in the engine process itself, before the next step is scheduled.  The
call answers only then, after the outputs of those steps.  Steps are counted where vLLM
counts them (one forward pass, which may carry several requests, and with speculation several
tokens of each).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from samrollout.vllm_plugins.post_import import patch_on_import

logger = logging.getLogger("vllm.samrollout.vllm_plugins.engine_steps")
_TARGET_MODULE = "vllm.v1.engine.core"
METHOD = "samrollout_run_steps"  # the utility method's name on vLLM's EngineCore


class _Countdown:
    """The steps a `run_steps` call asked for, those run so far, and the future that answers it."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.ran = 0
        self.answer: Future[int] = Future()


def _pause_state(name: str) -> Any:
    """vLLM's scheduler pause state ``name`` ("PAUSED_ALL" is what "keep" sets)."""
    from vllm.v1.core.sched.interface import PauseState

    return PauseState[name]


def _hold(core: Any, countdown: _Countdown) -> None:
    """Pause ``core``'s scheduler as "keep" does and answer the call with the steps it ran."""
    core.scheduler.set_pause_state(_pause_state("PAUSED_ALL"))
    core._samrollout_countdown = None
    countdown.answer.set_result(countdown.ran)


def run_steps(self: Any, steps: int) -> Future[int]:
    """Unpause this engine's scheduler for ``steps`` model steps, then pause it as "keep"; answers the steps run."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    countdown = _Countdown(steps)
    self._samrollout_countdown = countdown
    self.scheduler.set_pause_state(_pause_state("UNPAUSED"))
    if not self.scheduler.has_requests():  # nothing to run: held again at once
        _hold(self, countdown)
    return countdown.answer


def counting_post_step(original: Any) -> Any:
    """vLLM's ``EngineCore.post_step``, then one step off a `run_steps` countdown (held again at zero)."""

    def post_step(self: Any, model_executed: bool) -> None:
        original(self, model_executed)
        countdown: _Countdown | None = getattr(self, "_samrollout_countdown", None)
        if countdown is None:
            return
        if model_executed:
            countdown.ran += 1
        if countdown.ran >= countdown.steps or not self.scheduler.has_requests():
            _hold(self, countdown)

    post_step.__samrollout_patched__ = True  # type: ignore[attr-defined]
    return post_step


def patch(module: Any) -> bool:
    """Give ``module.EngineCore`` `run_steps` and a counting ``post_step``, once; False if it looks unexpected."""
    core = getattr(module, "EngineCore", None)
    if core is None or not callable(getattr(core, "post_step", None)):
        logger.warning("samrollout: %s has no EngineCore.post_step; /admin/step is unavailable", _TARGET_MODULE)
        return False
    if getattr(core.post_step, "__samrollout_patched__", False):
        return True
    core.post_step = counting_post_step(core.post_step)
    setattr(core, METHOD, run_steps)
    return True


def register() -> None:
    """vLLM general plugin entry point: patch the engine core once vLLM imports it (never raises)."""
    patch_on_import(_TARGET_MODULE, patch, "/admin/step is unavailable", logger)
