"""The Ray actor behind one veRL rollout replica: veRL's server calls, over HTTP to a samrollout server.

veRL's agent loops call ``generate(request_id, prompt_ids=..., sampling_params=...)`` on
a replica's server handle and expect a `TokenOutput`; its trainer calls
``abort_all_requests``, ``resume_generation``, ``clear_kv_cache``, ``sleep``, ``wake_up``
around weight updates.  Each maps to samrollout's HTTP API:

- ``generate`` -> ``POST /v1/completions`` with the prompt's token ids, a ``rollout_id``
  per weight version (``verl-v<version>``) and a ``group_id`` per prompt (the GRPO
  siblings: veRL sends no group id, and the responses to one prompt share its token ids);
- ``abort_all_requests`` -> ``POST /admin/pause {"mode": "abort"}`` (running responses
  come back with stop reason ``aborted``; later calls wait here, or come back aborted at
  once with ``reject_request``) and ``POST /admin/reset_prefix_cache``;
  With ``in_flight: "continue"`` or ``"continue-keep-kv"``, ``abort_all_requests`` without
  ``reject_request`` does nothing (running responses carry on across a weight update);
- ``resume_generation`` -> ``POST /admin/resume``; ``clear_kv_cache`` -> ``POST /admin/reset_prefix_cache``;
- ``abort_request`` -> the HTTP request is dropped, which aborts it in the engine;
- ``update_weights`` / ``execute_checkpoint_engine`` (veRL's checkpoint-engine sync treats this
  actor as the replica's rollout worker) -> nothing: the trainer pushes the weights itself;
- ``sleep`` / ``wake_up`` -> nothing (a samrollout server owns its accelerators, as veRL's
  standalone vLLM servers do), or ``/admin/sleep`` / ``/admin/wake`` with ``sleep_servers``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

import httpx

from samrollout_client.errors import error_message
from samrollout_client.protocol.modes import CONTINUING
from samrollout_client.verl.sampling import LengthBudget, completion_body, global_steps, reply_fields
from samrollout_client.verl.settings import VerlBackendSettings

logger = logging.getLogger("samrollout_client.verl")


class ServerCallError(RuntimeError):
    """A samrollout server refused or failed a call; the message carries its status and error."""


class SamrolloutServer:
    """One samrollout server as veRL's rollout server handle (wrapped with ``ray.remote`` by the replica)."""

    def __init__(self, settings: VerlBackendSettings, url: str, *, prompt_length: int, response_length: int,
                 replica_rank: int = 0, seed: int | None = None) -> None:
        self.settings, self.url, self.replica_rank = settings, url.rstrip("/"), replica_rank
        self.prompt_length, self.response_length, self.seed = prompt_length, response_length, seed
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=settings.request_timeout_s,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.model = ""
        self.budget = LengthBudget(prompt_length, response_length, prompt_length + response_length)
        self.weight_version: str | None = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._rejecting = False
        self._running: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self._drained = asyncio.Event()
        self._drained.set()

    async def connect(self) -> str:
        """Reach the server, learn its model name, context and weight version; returns ``host:port``."""
        models = await self._call("GET", "/v1/models")
        first = models["data"][0]
        self.model = str(first["id"])
        self.budget = LengthBudget(self.prompt_length, self.response_length,
                                   int(first.get("max_model_len") or self.prompt_length + self.response_length))
        self.weight_version = (await self._call("GET", "/health")).get("weight_version")
        return urlsplit(self.url).netloc

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: dict[str, Any] | None = None, priority: int = 0,
                       **_: Any) -> Any:
        """One response to ``prompt_ids`` as veRL's `TokenOutput` (token ids, logprobs when asked, stop reason)."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None or audio_data is not None or mm_processor_kwargs:
            raise NotImplementedError("the samrollout rollout backend serves text prompts only (no image, "
                                      "video or audio data)")
        while not self._gate.is_set():
            if self._rejecting:
                return TokenOutput(token_ids=[], stop_reason="aborted",
                                   extra_fields={"global_steps": global_steps(self.weight_version)})
            await self._gate.wait()
        want_logprobs = bool(sampling_params.get("logprobs"))
        default_seed = self.replica_rank + self.seed if self.seed is not None else None
        body = completion_body(self.model, prompt_ids, sampling_params, self.budget,
                               rollout_id=f"verl-v{self.weight_version or 'initial'}", default_seed=default_seed,
                               extra=self.settings.extra)
        call = asyncio.create_task(self._call("POST", "/v1/completions", body))
        self._running[request_id] = call
        self._drained.clear()
        try:
            reply = await call
        except asyncio.CancelledError:
            if not call.cancelled():  # this coroutine itself was cancelled, not just its HTTP call
                raise
            return TokenOutput(token_ids=[], stop_reason="aborted",
                               extra_fields={"global_steps": global_steps(self.weight_version)})
        finally:
            self._running.pop(request_id, None)
            if not self._running:
                self._drained.set()
        fields = reply_fields(reply, want_logprobs)
        if fields["extra_fields"].get("weight_version") is not None:
            self.weight_version = str(fields["extra_fields"]["weight_version"])
        return TokenOutput(**fields)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Abort every running response (they return ``aborted``) and hold new ones until `resume_generation`.

        With ``in_flight: "continue"`` or ``"continue-keep-kv"`` and no ``reject_request`` (veRL's
        checkpoint-engine weight sync, `samrollout_client.verl.checkpoint_engine`), nothing: running
        responses carry on across the update, which the server commits at a token boundary itself.
        """
        if self.settings.in_flight in CONTINUING and not reject_request:
            return {"aborted_count": 0, "request_ids": []}
        self._gate.clear()
        self._rejecting = reject_request
        request_ids = list(self._running)
        await self._call("POST", "/admin/pause", {"mode": "abort"})
        if reset_prefix_cache:
            await self._call("POST", "/admin/reset_prefix_cache")
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_generation(self) -> None:
        """Let generation run again after `abort_all_requests` (with a continuing ``in_flight``: if it paused)."""
        if self.settings.in_flight in CONTINUING and self._gate.is_set():
            return
        await self._call("POST", "/admin/resume")
        self._rejecting = False
        self._gate.set()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = False) -> dict[str, Any]:
        """Abort one response: its HTTP request is dropped, and the server aborts it in the engine."""
        call = self._running.get(request_id)
        if call is None:
            return {"aborted": False, "request_id": request_id, "error": "not running here"}
        call.cancel()
        return {"aborted": True, "request_id": request_id}

    async def wait_for_requests_to_drain(self) -> None:
        """Return once no response is running through this actor."""
        await self._drained.wait()

    async def clear_kv_cache(self) -> None:
        """Drop the server's prefix cache."""
        await self._call("POST", "/admin/reset_prefix_cache")

    async def sleep(self) -> None:
        """Free the server's accelerator memory when ``sleep_servers`` is set; otherwise nothing."""
        if self.settings.sleep_servers:
            await self._call("POST", "/admin/sleep", {"level": 1})

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep` when ``sleep_servers`` is set; otherwise nothing."""
        if self.settings.sleep_servers:
            await self._call("POST", "/admin/wake")

    async def release_kv_cache(self) -> None:
        """Nothing: weights reach a samrollout server over HTTP, not into its KV-cache memory."""

    async def resume_kv_cache(self) -> None:
        """Nothing (see `release_kv_cache`)."""

    async def update_weights(self, global_steps: int | None = None) -> None:
        """Nothing: the trainer's rank 0 pushes the weights to the server over HTTP (veRL calls this on the
        rollout side of a checkpoint-engine sync, beside the trainer's ``send_weights``)."""

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Nothing: a samrollout server takes part in no checkpoint-engine process group (``prepare``,
        ``init_process_group``, ``finalize``)."""

    async def start_profile(self, **_: Any) -> None:
        """Nothing: profile the server with its own tools."""

    async def stop_profile(self) -> None:
        """Nothing (see `start_profile`)."""

    async def status(self) -> dict[str, Any]:
        """The server's ``/admin/status``."""
        return await self._call("GET", "/admin/status")

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            reply = await self._http.request(method, path, json=body)
        except httpx.HTTPError as error:
            raise ServerCallError(f"{self.url}{path}: {type(error).__name__}: {error}") from None
        if reply.status_code >= 400:
            raise ServerCallError(f"{self.url}{path} answered {reply.status_code}: {error_message(reply, 300)}")
        result: dict[str, Any] = reply.json() if reply.content else {}
        return result
