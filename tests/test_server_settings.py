"""`samrollout serve` settings: draft policy knobs reach the engine, bad settings stop start-up with a clear message."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from pydantic_settings import SettingsError

from samrollout.config import ADDITIONAL_CONFIG_KEY, SPECULATION_LIMITS, SpeculationConfig
from samrollout.drafter import DraftPolicy
from samrollout.server.engine.startup import open_weight_uploads
from samrollout.server.engine.vllm_argv import vllm_argv
from samrollout.server.settings import (
    NOT_FLAGS,
    ServerSettings,
    add_settings_flags,
    env_var,
    flag,
    settings_from_args,
    speculation_fields,
)
from samrollout.sim.cost import CostTable


def _speculation_in_argv(argv: list[str]) -> SpeculationConfig:
    """The speculation config the engine's worker will rebuild from the vLLM flags."""
    additional = json.loads(argv[argv.index("--additional-config") + 1])
    return SpeculationConfig.from_json(additional[ADDITIONAL_CONFIG_KEY])


def test_draft_policy_flag_reaches_the_engine_and_keeps_other_defaults() -> None:
    settings = ServerSettings(draft_policy={"min_match_length": 2, "source": "own"})
    policy = _speculation_in_argv(vllm_argv(settings, "m", "cpu")).policy
    assert policy == DraftPolicy(min_match_length=2, source="own")


def test_draft_policy_is_read_from_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAMROLLOUT_DRAFT_POLICY", '{"occurrence": "first"}')
    policy = _speculation_in_argv(vllm_argv(ServerSettings(), "m", "cuda")).policy
    assert policy.occurrence == "first"


def test_the_static_modes_draft_range_flag_reaches_the_engine_and_auto_is_each_devices_projected_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = _speculation_in_argv(vllm_argv(_settings("--threshold-mode", "static", "--draft-range", "2:16,8:8"),
                                              "m", "cpu"))
    assert explicit.draft_range == ((2, 16), (8, 8))
    auto = ServerSettings(threshold_mode="static")
    assert _speculation_in_argv(vllm_argv(auto, "m", "cpu")).draft_range is None  # CPU: --k up to --threshold
    assert _speculation_in_argv(vllm_argv(auto, "m", "npu")).draft_range is None
    assert _speculation_in_argv(vllm_argv(auto, "m", "cuda")).draft_range == ((32, 8), (256, 3))
    monkeypatch.setenv("SAMROLLOUT_DRAFT_RANGE", "none")
    assert _speculation_in_argv(vllm_argv(ServerSettings(threshold_mode="static"), "m", "cuda")).draft_range is None


def test_the_adaptive_policy_is_the_default_with_its_longest_draft_and_the_devices_cost_prior(tmp_path: Path) -> None:
    for device in ("cpu", "npu", "cuda"):
        argv = vllm_argv(ServerSettings(), "m", device)
        config = _speculation_in_argv(argv)
        assert config.threshold_mode == "adaptive" and config.draft_range is None and config.critical_rows == 0
        assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == config.max_draft
        shipped = device == "cuda"
        assert (config.cost_prior != "linear") == shipped
        if shipped:  # the H100 table the package ships loads as a cost table
            assert CostTable.load(config.cost_prior).device_name.startswith("NVIDIA H100")
    table = tmp_path / "table.json"
    table.write_text("{}")
    config = _speculation_in_argv(vllm_argv(_settings("--max-draft", "12", "--cost-prior", str(table),
                                                      "--critical-path", "4:16"), "m", "cuda"))
    chosen = (config.max_draft, config.cost_prior, config.critical_rows, config.critical_weight)
    assert chosen == (12, str(table), 4, 16)
    with pytest.raises(ValidationError, match="cost prior"):
        ServerSettings(cost_prior=str(tmp_path / "missing.json"))


@pytest.mark.parametrize(("flags", "env", "named"), [
    (["--k", "0"], {}, "k"),
    (["--draft-policy", '{"min_match_length": 0}'], {}, "min_match_length"),
    (["--draft-policy", '{"min_match_length": 2.5}'], {}, "min_match_length"),
    (["--draft-policy", '{"min_match": 2}'], {}, "min_match"),
    (["--draft-policy", "[2]"], {}, "--draft-policy"),
    (["--draft-policy", "{min_match_length: 2}"], {}, "--draft-policy"),
    ([], {"SAMROLLOUT_DRAFT_POLICY": '{"source": "siblings"}'}, "source"),
    ([], {"SAMROLLOUT_THRESHOLD_MODE": "sometimes"}, "threshold_mode"),
    (["--max-prompts", "0"], {}, "max_prompts"),
    (["--max-prompt-tokens", "0"], {}, "max_prompt_tokens"),
    (["--host", "0.0.0.0"], {}, "--api-key"),
    ([], {"SAMROLLOUT_HOST": "0.0.0.0"}, "--allow-unauthenticated-admin"),
    (["--host", "192.168.1.20", "--api-key", ""], {}, "api_key"),
    (["--api-key", "   "], {}, "the API key is blank"),
    ([], {"SAMROLLOUT_API_KEY": " \t "}, "the API key is blank"),
    (["--api-key", " key-with-space-around "], {}, "whitespace"),
    (["--api-key", "clé"], {}, "printable ASCII"),
    (["--max-request-bytes", "10"], {}, "max_request_bytes"),
    (["--max-connections", "0"], {}, "max_connections"),
    (["--header-timeout", "0"], {}, "header_timeout"),
    (["--max-queued-requests", "-1"], {}, "max_queued_requests"),
    ([], {"SAMROLLOUT_WEIGHT_CHECK_TIMEOUT": "0"}, "weight_check_timeout"),
    (["--max-weight-upload-bytes", "0"], {}, "max_weight_upload_bytes"),
    (["--draft-range", "8:3,4:16"], {}, "draft_range"),
    ([], {"SAMROLLOUT_DRAFT_RANGE": "8"}, "draft_range"),
    ([], {"SAMROLLOUT_WEIGHT_UPLOAD_IDLE_SECONDS": "0"}, "weight_upload_idle_seconds"),
    (["--weight-peers", "http://a:8000,10.0.0.2:8000"], {}, "weight_peers"),
    (["--areal-routes"], {}, "set --weights-root DIR"),
    (["--areal-routes", "--api-key", "k", "--weights-root", "/tmp"], {}, "needs --areal-port"),
    (["--areal-port", "9001"], {}, "needs --areal-routes"),
    (["--areal-routes", "--allow-any-weights-path", "--areal-port", "8000"], {}, "a port of its own"),
])
def test_invalid_settings_stop_serve_at_start_up_naming_the_setting(flags: list[str], env: dict[str, str],
                                                                      named: str) -> None:
    result = subprocess.run([sys.executable, "-m", "samrollout.cli", "serve", *flags], capture_output=True,
                            text=True, timeout=300, env={**os.environ, **env})
    assert result.returncode == 2, result.stderr[-3000:]
    assert named in result.stderr
    assert "starting on" not in result.stderr  # stopped before any model or engine start


def _settings(*flags: str) -> ServerSettings:
    """Settings as `samrollout serve FLAGS` makes them (no environment variables of ours set)."""
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return settings_from_args(parser.parse_args(list(flags)))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "localhost", "::ffff:127.0.0.1"])
def test_loopback_hosts_serve_without_a_key(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SAMROLLOUT_API_KEY", raising=False)
    assert _settings("--host", host).host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "rollout.example.com"])
def test_other_hosts_need_a_key_or_the_explicit_override(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SAMROLLOUT_API_KEY", "SAMROLLOUT_ALLOW_UNAUTHENTICATED_ADMIN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValidationError, match="no --api-key is set"):
        _settings("--host", host)
    assert _settings("--host", host, "--api-key", "k").api_key is not None
    assert _settings("--host", host, "--allow-unauthenticated-admin").allow_unauthenticated_admin
    monkeypatch.setenv("SAMROLLOUT_ALLOW_UNAUTHENTICATED_ADMIN", "true")
    assert _settings("--host", host).api_key is None


def test_areal_routes_are_off_by_default_and_start_at_areals_version_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--areal-routes`` (or SAMROLLOUT_AREAL_ROUTES) turns AReaL's routes on; the weights are then version 0, as
    AReaL counts, unless --weight-version names one."""
    for name in ("SAMROLLOUT_API_KEY", "SAMROLLOUT_AREAL_ROUTES", "SAMROLLOUT_WEIGHT_VERSION",
                 "SAMROLLOUT_WEIGHTS_ROOT", "SAMROLLOUT_ALLOW_ANY_WEIGHTS_PATH", "SAMROLLOUT_AREAL_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not _settings().areal_routes and _settings().weight_version == "initial"
    assert _settings("--areal-routes", "--weights-root", "/ckpt").weight_version == "0"
    assert _settings("--areal-routes", "--allow-any-weights-path", "--weight-version", "7").weight_version == "7"
    monkeypatch.setenv("SAMROLLOUT_AREAL_ROUTES", "true")
    monkeypatch.setenv("SAMROLLOUT_WEIGHTS_ROOT", "/ckpt")
    assert _settings().areal_routes and _settings().weight_version == "0"


def test_areal_routes_take_a_key_together_with_the_trainers_own_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key protects /admin, the uploads and /docs with AReaL's routes on; AReaL, which sends none, gets a port of
    its own (the refusals without one: `test_invalid_settings_stop_serve_at_start_up_naming_the_setting`)."""
    for name in ("SAMROLLOUT_API_KEY", "SAMROLLOUT_AREAL_ROUTES", "SAMROLLOUT_WEIGHTS_ROOT", "SAMROLLOUT_AREAL_PORT"):
        monkeypatch.delenv(name, raising=False)
    settings = _settings("--areal-routes", "--api-key", "k", "--areal-port", "9001", "--weights-root", "/ckpt",
                         "--host", "0.0.0.0")
    assert settings.api_key is not None and settings.areal_port == 9001 and settings.weights_root == "/ckpt"


def test_request_limits_have_documented_defaults_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SAMROLLOUT_MAX_PROMPTS", raising=False)
    monkeypatch.delenv("SAMROLLOUT_MAX_PROMPT_TOKENS", raising=False)
    defaults = _settings()
    assert (defaults.max_prompts, defaults.max_prompt_tokens, defaults.max_n) == (256, None, 64)
    limited = _settings("--max-prompts", "8", "--max-prompt-tokens", "100")
    assert (limited.max_prompts, limited.max_prompt_tokens) == (8, 100)
    monkeypatch.setenv("SAMROLLOUT_MAX_PROMPT_TOKENS", "300")
    assert _settings().max_prompt_tokens == 300


def test_safety_limits_have_documented_defaults_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("MAX_REQUEST_BYTES", "MAX_CONNECTIONS", "HEADER_TIMEOUT", "KEEP_ALIVE_TIMEOUT", "MAX_QUEUED_REQUESTS",
             "WEIGHT_VALUE_CHECK", "WEIGHT_CHECK_TIMEOUT")
    for name in names:
        monkeypatch.delenv(f"SAMROLLOUT_{name}", raising=False)
    defaults = _settings()
    assert (defaults.max_request_bytes, defaults.max_connections, defaults.header_timeout,
            defaults.keep_alive_timeout, defaults.max_queued_requests) == (32 * 1024 * 1024, 1024, 15.0, 5, 16384)
    assert (defaults.weight_value_check, defaults.weight_check_timeout) == (True, 600.0)
    given = _settings("--max-request-bytes", "2048", "--max-connections", "10", "--header-timeout", "2.5",
                      "--keep-alive-timeout", "9", "--max-queued-requests", "0", "--no-weight-value-check",
                      "--weight-check-timeout", "30")
    assert (given.max_request_bytes, given.max_connections, given.header_timeout, given.keep_alive_timeout,
            given.max_queued_requests, given.weight_value_check, given.weight_check_timeout) == (
        2048, 10, 2.5, 9, 0, False, 30.0)
    monkeypatch.setenv("SAMROLLOUT_WEIGHT_VALUE_CHECK", "false")
    monkeypatch.setenv("SAMROLLOUT_MAX_QUEUED_REQUESTS", "7")
    assert (_settings().weight_value_check, _settings().max_queued_requests) == (False, 7)


def test_weight_upload_settings_have_documented_defaults_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WEIGHT_STAGING_DIR", "MAX_WEIGHT_UPLOAD_BYTES", "MAX_WEIGHT_UPLOADS", "WEIGHT_UPLOAD_IDLE_SECONDS"):
        monkeypatch.delenv(f"SAMROLLOUT_{name}", raising=False)
    defaults = _settings()
    assert (defaults.weight_staging_dir, defaults.max_weight_upload_bytes) == (None, None)
    assert (defaults.max_weight_uploads, defaults.weight_upload_idle_seconds) == (2, 600.0)
    given = _settings("--weight-staging-dir", "/scratch", "--max-weight-upload-bytes", "1000",
                      "--max-weight-uploads", "3", "--weight-upload-idle-seconds", "30")
    assert (given.weight_staging_dir, given.max_weight_upload_bytes, given.max_weight_uploads,
            given.weight_upload_idle_seconds) == ("/scratch", 1000, 3, 30.0)
    monkeypatch.setenv("SAMROLLOUT_MAX_WEIGHT_UPLOAD_BYTES", "5000")
    assert _settings().max_weight_upload_bytes == 5000


def test_weight_uploads_stage_under_the_configured_dir_with_a_bound_from_the_served_checkpoint(
        tmp_path: Path) -> None:
    layout = {"a": ((1024, 1024), "BF16"), "b": ((10,), "F32")}  # 2 MiB + 40 bytes of tensors
    uploads = open_weight_uploads(ServerSettings(weight_staging_dir=str(tmp_path / "staging")), layout)
    try:
        assert uploads.folder.parent == tmp_path / "staging"
        assert uploads.max_bytes == 2 * (2 * 2**20 + 40) + 64 * 2**20
    finally:
        uploads.close()
    assert not uploads.folder.exists()
    unknown = open_weight_uploads(ServerSettings(weight_staging_dir=str(tmp_path / "s2"), max_weight_uploads=1), None)
    assert unknown.max_bytes == 64 * 2**30 and unknown.max_uploads == 1
    unknown.close()
    assert open_weight_uploads(ServerSettings(weight_staging_dir=str(tmp_path), max_weight_upload_bytes=7),
                               layout).max_bytes == 7


def test_a_staging_dir_that_cannot_be_made_stops_the_start_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(RuntimeError, match=r"a-file/staging.*--weight-staging-dir"):
        open_weight_uploads(ServerSettings(weight_staging_dir=str(tmp_path / "a-file" / "staging")), None)


def _docs_hook() -> Any:
    """docs/hooks/settings_reference.py, the MkDocs hook that renders docs/settings.md's table."""
    path = Path(__file__).resolve().parents[1] / "docs" / "hooks" / "settings_reference.py"
    spec = importlib.util.spec_from_file_location("settings_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_a_flag_a_variable_a_helm_value_and_a_docs_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """One settings model: each field is a --flag, a SAMROLLOUT_* variable, a Helm value and a row of the docs."""
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    schema = json.loads((Path(__file__).resolve().parents[1] / "deploy/helm/samrollout/values.schema.json")
                        .read_text())["properties"]["server"]["properties"]
    hook = _docs_hook()
    table = hook.settings_table()
    page = (Path(__file__).resolve().parents[1] / "docs" / hook.PAGE).read_text()
    assert hook.MARKER in page
    for name, field in ServerSettings.model_fields.items():
        if name not in NOT_FLAGS:
            assert flag(name) in flags, name
        assert field.description, f"{name} has no description (its help and docs line)"
        monkeypatch.setenv(env_var(name), "{not a value}")
        try:  # the variable is read: refused naming the setting, or taken as the (string) value
            assert getattr(ServerSettings(), name) == "{not a value}", name
        except (ValidationError, SettingsError) as error:
            assert name in str(error), name
        monkeypatch.delenv(env_var(name))
        helm = hook.helm_value(name)
        assert name in hook.HELM_OTHERWISE or helm.strip("`").removeprefix("server.") in schema, name
        assert f"`{env_var(name)}` | {helm} |" in table, name


def test_speculation_settings_take_the_python_configs_defaults_and_ranges() -> None:
    """The server's speculation settings accept exactly what `SpeculationConfig` accepts, with its defaults."""
    marked = speculation_fields()
    assert set(marked.values()) >= {"k", "threshold", "threshold_mode", "group_drafting", "confident_match",
                                     "history_tokens", "history_responses"}
    config = ServerSettings().speculation_config("cpu")
    assert config is not None
    for setting, target in marked.items():
        field = ServerSettings.model_fields[setting]
        assert field.get_default() == getattr(SpeculationConfig(), target) == getattr(config, target), setting
        if target in SPECULATION_LIMITS:
            low, high = SPECULATION_LIMITS[target]
            with pytest.raises(ValidationError):
                ServerSettings(**{setting: low - 1})
            with pytest.raises(ValueError, match=target):
                SpeculationConfig(**{target: low - 1})
            if high is not None:
                ServerSettings(**{setting: high})
                with pytest.raises(ValidationError):
                    ServerSettings(**{setting: high + 1})
                with pytest.raises(ValueError, match=target):
                    SpeculationConfig(**{target: high + 1})
