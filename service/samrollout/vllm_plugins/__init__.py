"""vLLM general plugins (``vllm.general_plugins`` entry points in pyproject.toml), loaded by every vLLM process:
vllm-ascend's custom-class proposer (`ascend_plugin`), seeded requests under chunked prefill on CPU
(`seeded_chunked_prefill`), counted steps of a held engine (`engine_steps`), and the post-import hook they patch
vLLM with (`post_import`).  The speculative-decoding plugins live with the proposer in `samrollout.spec_decode`.
"""
