"""samrollout as AReaL's rollout server (AReaL 1.0.x, ``rollout.backend=vllm``).

Two ways in, both against servers started with ``samrollout serve --areal-routes``:

- **No code:** AReaL's own ``RemotevLLMEngine`` calls the routes of AReaL's vLLM server,
  which samrollout serves under the same names (`samrollout.server.areal.areal_routes`).  A pause
  aborts the requests in flight; AReaL sends them again with their tokens so far and labels
  each reply's tokens with the version it holds when the reply arrives.
- **One line in the training script:** `use_samrollout_engine` makes AReaL's trainer build
  `engine.SamrolloutEngine` instead.  It keeps a prompt's responses (AReaL sends each as
  its own request) on one server, so they draft from one group automaton; pauses freeze the
  requests in flight, which go on under the new weights within the same response (nothing is
  sent again); each token's version is the server's (`backend.SamrolloutBackend`); a server
  that dies is dropped and its responses start again on the others.

Nothing here is imported by `samrollout_client` itself: the client works without AReaL.
"""

from samrollout_client.areal.backend import SamrolloutBackend
from samrollout_client.areal.engine import SamrolloutEngine, SamrolloutInfEngine, use_samrollout_engine

__all__ = ["SamrolloutBackend", "SamrolloutEngine", "SamrolloutInfEngine", "use_samrollout_engine"]
