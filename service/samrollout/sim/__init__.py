"""Rollout simulation: what a step of the target model costs, measured tables and their interpolation."""
