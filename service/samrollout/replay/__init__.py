"""Replay benchmark: how much would speculation help on my rollouts?"""
