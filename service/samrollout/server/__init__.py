"""The rollout server: vLLM's OpenAI-compatible serving over one in-process AsyncLLM, plus RL controls.

`samrollout serve` starts it (`samrollout.server.command`); `build_app` builds the
FastAPI application for a given `ServerSettings`.
"""
