"""What one HTTP generation request holds while it runs, and how it is given back: its engine request ids
(`engine_ids`), its place in the in-flight registry (`inflight`) and in the bounded queue (`queue_limit`), its end
(`request_end`), its streamed choices' endings (`stream_endings`), and the hold new requests wait at
(`request_hold`).

May import `errors`, `settings` and `vllm_compat`.
"""

MAY_IMPORT = ("vllm_compat", "errors", "settings")
