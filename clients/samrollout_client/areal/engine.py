"""`SamrolloutEngine`: AReaL's ``RemotevLLMEngine`` for samrollout servers, chosen by one line
(`use_samrollout_engine`).

What it adds to AReaL's engine (`SamrolloutInfEngine`, the ``RemoteInfEngine`` it wraps, whose
``agenerate`` AReaL's workflows call):

- **A prompt's responses on one server.**  AReaL sends each of a group's responses as its own
  request and spreads them round-robin.  Here requests go by samrollout's one stickiness rule
  (`samrollout_client.placement.StickyGroups`, as veRL's router does): a request id AReaL sent
  before goes back to its server (AReaL's own multi-turn stickiness), else the first response of
  a prompt goes to its history-affine server (rendezvous hashing of the prompt's token ids, within
  1.25x of a server's share of the requests in flight) and the others follow it while any is in
  flight, so the server groups them by prompt and they draft from one automaton; the prompt comes
  back to the same server in later steps (its history).
- **The server's versions.**  Each token's version in ``ModelResponse.output_versions`` is the
  one the server says sampled it (`backend.SamrolloutBackend`), not the version the client
  held when the reply arrived; pauses freeze requests, which carry on under the new weights
  within the same response.
- **A dead server is dropped.**  AReaL keeps sending to a server that died (and a pause or a
  weight update then fails the step).  Here a request that fails on a server that no longer
  answers ``/health`` starts its response again on another one, and the server leaves the
  list used for pauses and weight updates (`dropped_servers`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import HttpRequest, ModelRequest, ModelResponse, WeightUpdateMeta
from areal.engine.vllm_remote import RemotevLLMEngine
from areal.infra.remote_inf_engine import RID_CACHE_SIZE, RemoteInfBackendProtocol, RemoteInfEngine

from samrollout_client.areal.backend import REPLY_VERSIONS, ReplyVersions, SamrolloutBackend
from samrollout_client.placement import StickyGroups
from samrollout_client.protocol.prompt_identity import prompt_id

logger = logging.getLogger("samrollout_client.areal")
WeightTransfer = Literal["path", "push"]
SAVE_TIMEOUT_S = 120.0  # how long a push waits for the trainer's "saved" record, as AReaL's own update does


class SamrolloutInfEngine(RemoteInfEngine):  # type: ignore[misc]  # AReaL ships no type information
    """AReaL's ``RemoteInfEngine`` with group placement, server-side versions and dead servers dropped."""

    addresses: list[str]  # set by AReaL (``initialize``): the servers, host:port
    weight_transfer: WeightTransfer = "path"
    """How a disk weight update reaches the servers: they read AReaL's checkpoint directory ("path", a disk both
    see), or its files are pushed to them over HTTP ("push", no shared disk; `use_samrollout_engine`)."""
    api_key: str | None = None
    """The servers' API key, for a push: the upload routes keep the key also on the trainer's own port."""

    def __init__(self, config: InferenceEngineConfig, backend: RemoteInfBackendProtocol | None = None) -> None:
        super().__init__(config, backend or SamrolloutBackend())
        self._groups = StickyGroups()
        self._pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="samrollout-weight-push")
        self.dropped_servers: list[str] = []
        """Servers dropped after they stopped answering, in the order they were dropped."""

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """AReaL's generation on the prompt's server, with the server's per-token versions; a response whose
        server died starts again on another (as many times as there are servers)."""
        tries = len(self.addresses)
        while True:
            server = self._place(req)
            collected = ReplyVersions()
            token = REPLY_VERSIONS.set(collected)
            try:
                response: ModelResponse = await super().agenerate(req)
            except Exception:
                tries -= 1
                if tries <= 0 or not await asyncio.to_thread(self._drop_if_dead, server):
                    raise
                logger.warning("request %s: server %s died; its response starts again on another server",
                               req.rid, server)
                continue
            finally:
                REPLY_VERSIONS.reset(token)
                self._groups.release(req.rid)
            versions = collected.apply(list(response.output_versions))
            if versions is None:
                logger.warning("request %s: the replies' versions do not add up to its %d tokens; AReaL's own are "
                               "kept", req.rid, len(response.output_versions))
            else:
                response.output_versions = versions
            return response

    def _place(self, req: ModelRequest) -> str:
        """The server for ``req`` by `StickyGroups` (where its request id went before, else where its prompt's
        other responses are, else the prompt's affine server), recorded where AReaL's generation looks it up."""
        servers = list(self.addresses)
        server = self._groups.acquire(req.rid, prompt_id(req.input_ids), servers,
                                      earlier=self.rid_to_address.get(req.rid))
        if req.rid not in self.rid_to_address:
            if len(self.rid_queue) >= RID_CACHE_SIZE:
                self.rid_to_address.pop(self.rid_queue.pop(0), None)
            self.rid_queue.append(req.rid)
        self.rid_to_address[req.rid] = server
        return server

    def _drop_if_dead(self, server: str) -> bool:
        """Drop ``server`` when it no longer answers ``/health`` and others remain; True when it is gone."""
        if server not in self.addresses:
            return True
        if len(self.addresses) <= 1 or self.check_health(f"http://{server}"):
            return False
        with self.lock:
            if server not in self.addresses:  # another request found it dead meanwhile
                return True
            self.addresses = [address for address in self.addresses if address != server]
            self.server_idx %= len(self.addresses)
            self.dropped_servers.append(server)
        logger.warning("samrollout server %s does not answer /health: dropped; %d servers remain", server,
                       len(self.addresses))
        return True

    def _drop_dead_servers(self) -> bool:
        """Drop every server that no longer answers (one at least stays); True when any was dropped."""
        return any([self._drop_if_dead(server) for server in list(self.addresses)])

    def _run_request_on_all_servers(self, req: HttpRequest) -> None:
        """A pause, continue, offload or onload on every server; when it fails because servers died, on the rest."""
        try:
            super()._run_request_on_all_servers(req)
        except Exception:
            if not self._drop_dead_servers():
                raise
            super()._run_request_on_all_servers(req)

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future[None]:
        """AReaL's disk update on every server (by path, or pushed over HTTP: `weight_transfer`); when it fails
        because servers died, once more on the rest."""
        result: Future[None] = Future()

        def settle(first: Future[None]) -> None:
            error = first.exception()
            if error is None:
                result.set_result(None)
            elif not self._drop_dead_servers():
                result.set_exception(error)
            else:
                self._start_update(meta).add_done_callback(lambda again: _copy_outcome(again, result))

        self._start_update(meta).add_done_callback(settle)
        return result

    def destroy(self) -> None:
        """AReaL's teardown, and the thread that pushes weights."""
        super().destroy()
        self._pusher.shutdown(wait=False)

    def _start_update(self, meta: WeightUpdateMeta) -> Future[None]:
        """One attempt: AReaL's own (each server reads ``meta.path``) or a push of its files."""
        if self.weight_transfer == "path":
            update: Future[None] = super().update_weights_from_disk(meta)
            return update
        return self._pusher.submit(self._push_checkpoint, meta, self.get_version(), list(self.addresses))

    def _push_checkpoint(self, meta: WeightUpdateMeta, model_version: int, servers: list[str]) -> None:
        """Once AReaL's trainer has recorded the checkpoint as saved, push its files to ``servers`` (relayed server
        to server where they are each other's ``--weight-peers``), load them as version N of ``weight_update_vN``
        (requests frozen by the pause carry on under them), then delete the directory as AReaL does."""
        from areal.utils import name_resolve, names

        from samrollout_client.protocol.areal_checkpoints import areal_version
        from samrollout_client.sync import RolloutClient

        saved = names.update_weights_from_disk(self.config.experiment_name, self.config.trial_name, model_version)
        name_resolve.wait(saved, timeout=SAVE_TIMEOUT_S)
        with RolloutClient([f"http://{server}" for server in servers], model="areal", api_key=self.api_key,
                           request_timeout_s=self.config.request_timeout) as client:
            client.push_weights(str(meta.path), areal_version(str(meta.path)), "continue",
                                timeout_s=self.config.request_timeout)
        if meta.clear_checkpoint_after_load:
            shutil.rmtree(meta.path, ignore_errors=True)


def _copy_outcome(source: Future[Any], target: Future[Any]) -> None:
    error = source.exception()
    if error is None:
        target.set_result(source.result())
    else:
        target.set_exception(error)


class SamrolloutEngine(RemotevLLMEngine):  # type: ignore[misc]  # AReaL ships no type information
    """AReaL's ``RemotevLLMEngine`` on `SamrolloutInfEngine`: what `use_samrollout_engine` puts in the trainer."""

    def __init__(self, config: InferenceEngineConfig) -> None:
        super().__init__(config)
        self._engine = SamrolloutInfEngine(config)

    @property
    def dropped_servers(self) -> list[str]:
        """Servers dropped after they stopped answering (`SamrolloutInfEngine.dropped_servers`)."""
        return list(self._engine.dropped_servers)


def use_samrollout_engine(weight_transfer: WeightTransfer = "path", api_key: str | None = None) -> None:
    """Make AReaL's trainer (``areal.trainer.rl_trainer``, ``rollout.backend=vllm``) build `SamrolloutEngine`.

    AReaL chooses its engine class by name in code (``rl_trainer.py``: ``engine_cls =
    RemotevLLMEngine``); no configuration key chooses another.  Call this in the training
    script before the trainer is made (SPMD mode, servers given by ``AREAL_LLM_SERVER_ADDRS``).
    ``weight_transfer``: "path" (the servers read AReaL's checkpoint directory: a disk both see)
    or "push" (its files are sent to the servers over HTTP: no shared disk), with ``api_key`` when the servers
    have one (AReaL's own routes on their ``--areal-port`` need none; the upload routes do).
    """
    from areal.trainer import rl_trainer

    SamrolloutInfEngine.weight_transfer = weight_transfer
    SamrolloutInfEngine.api_key = api_key
    rl_trainer.RemotevLLMEngine = SamrolloutEngine
