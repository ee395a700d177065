"""Command line: ``samrollout <command>``."""
