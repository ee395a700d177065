"""`samrollout serve` settings: draft policy knobs reach the engine, bad settings stop start-up with a clear message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from samrollout.config import ADDITIONAL_CONFIG_KEY, SpeculationConfig
from samrollout.drafter import DraftPolicy
from samrollout.server.settings import ServerSettings


def _speculation_in_argv(argv: list[str]) -> SpeculationConfig:
    """The speculation config the engine's worker will rebuild from the vLLM flags."""
    additional = json.loads(argv[argv.index("--additional-config") + 1])
    return SpeculationConfig.from_json(additional[ADDITIONAL_CONFIG_KEY])


def test_draft_policy_flag_reaches_the_engine_and_keeps_other_defaults() -> None:
    settings = ServerSettings(draft_policy={"min_match_length": 2, "source": "own"})
    policy = _speculation_in_argv(settings.vllm_argv("m", on_cpu=True)).policy
    assert policy == DraftPolicy(min_match_length=2, source="own")


def test_draft_policy_is_read_from_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAMROLLOUT_DRAFT_POLICY", '{"occurrence": "first"}')
    policy = _speculation_in_argv(ServerSettings().vllm_argv("m", on_cpu=False)).policy
    assert policy.occurrence == "first"


@pytest.mark.parametrize(("flags", "env", "named"), [
    (["--k", "0"], {}, "k"),
    (["--draft-policy", '{"min_match_length": 0}'], {}, "min_match_length"),
    (["--draft-policy", '{"min_match_length": 2.5}'], {}, "min_match_length"),
    (["--draft-policy", '{"min_match": 2}'], {}, "min_match"),
    (["--draft-policy", "[2]"], {}, "--draft-policy"),
    (["--draft-policy", "{min_match_length: 2}"], {}, "--draft-policy"),
    ([], {"SAMROLLOUT_DRAFT_POLICY": '{"source": "siblings"}'}, "source"),
    ([], {"SAMROLLOUT_THRESHOLD_MODE": "sometimes"}, "threshold_mode"),
])
def test_invalid_settings_stop_serve_at_start_up_naming_the_setting(flags: list[str], env: dict[str, str],
                                                                      named: str) -> None:
    result = subprocess.run([sys.executable, "-m", "samrollout.cli", "serve", *flags], capture_output=True,
                            text=True, timeout=300, env={**os.environ, **env})
    assert result.returncode == 2, result.stderr[-3000:]
    assert named in result.stderr
    assert "starting on" not in result.stderr  # stopped before any model or engine start
