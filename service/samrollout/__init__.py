"""samrollout: a rollout server for LLM RL with suffix-automaton speculative decoding."""

from samrollout.drafter import DraftPolicy, SamDrafter

__all__ = ["DraftPolicy", "SamDrafter"]
__version__ = "0.1.0"
