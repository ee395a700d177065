"""vLLM's serving layer as each supported release lays it out: one module per release series.

Every module here exports the same names (its ``__all__``); `samrollout.server.vllm_compat.vllm_serving`
imports the one that matches the installed vLLM (`samrollout.server.vllm_compat.vllm_version`), so
nothing else in the server depends on where a release keeps its pieces.
"""
