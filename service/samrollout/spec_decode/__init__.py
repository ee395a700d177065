"""SAM speculative decoding inside vLLM: the proposer, its batch-size gate, and the vllm-ascend plugin."""
