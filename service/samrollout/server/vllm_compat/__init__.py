"""vLLM's serving layer, whichever supported release is installed: `vllm_serving` exports the same names from the
release's own layout (`vllm_layouts`), `vllm_version` says which release runs.

May import no other part of the server: everything above relies on it, it relies on vLLM alone.
"""

MAY_IMPORT: tuple[str, ...] = ()
