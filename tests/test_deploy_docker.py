"""The Dockerfile and docker-compose.yml: linted, valid, and consistent with docs/deploy.md and deploy/.

There is no Docker engine on CI machines, so the images are not built here.  What can be
checked without one is: hadolint and shellcheck pass, each image target runs docs/deploy.md's
serving install for its backend and has the runtime contract the chart and compose file rely
on (non-root user, port 8000, /health check, /models volume, entrypoint), the entrypoint and
the health check script work for real, the build context keeps what the build needs, and the
compose file validates against the Compose Specification and points at the repo's Prometheus
and Grafana configuration.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"
TARGETS = ("cpu", "cuda", "ascend")


def _stages() -> dict[str, list[dict[str, Any]]]:
    """Instructions of each named stage of the Dockerfile (ARG before the first FROM dropped)."""
    stages: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for item in DockerfileParser(str(DOCKERFILE)).structure:
        if item["instruction"] == "FROM":
            name = item["value"].split()[-1]
            current = stages.setdefault(name, [])
        elif current is not None and item["instruction"] != "COMMENT":
            current.append(item)
    return stages


def _values(stage: list[dict[str, Any]], instruction: str) -> list[str]:
    return [item["value"] for item in stage if item["instruction"] == instruction]


def _normalise(command: str) -> str:
    return " ".join(command.replace("\\\n", " ").split())


def readme_serving_installs() -> dict[str, str]:
    """backend -> command, from the serving-install block of docs/deploy.md."""
    page = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"<!-- serving-install:.*?-->\s*```text\n(.*?)```", page, re.S)
    assert block, "docs/deploy.md has no serving-install block"
    lines = [line.split(":", 1) for line in block.group(1).strip().splitlines()]
    return {backend.strip(): command.strip() for backend, command in lines}


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(["hadolint", "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_passes_shellcheck() -> None:
    result = subprocess.run(["shellcheck", str(ENTRYPOINT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_lists_a_serving_install_for_every_image_target() -> None:
    assert set(readme_serving_installs()) == set(TARGETS)


@pytest.mark.parametrize("target", TARGETS)
def test_each_image_target_builds_with_the_readme_serving_install(target: str) -> None:
    build = _stages()[f"{target}-build"]
    runs = [_normalise(value) for value in _values(build, "RUN")]
    command = readme_serving_installs()[target]
    assert any(command in run for run in runs), f"{target}-build does not run docs/deploy.md's `{command}`"
    # The C++ core is compiled there, not in the final image: the final stage copies the venv.
    final = _stages()[target]
    assert any("--from=" + f"{target}-build /opt/venv /opt/venv" in value for value in _values(final, "COPY"))
    assert not any("pip install" in value for value in _values(final, "RUN"))


@pytest.mark.parametrize("target", TARGETS)
def test_each_image_runs_samrollout_serve_as_non_root_with_health_check_and_model_volume(target: str) -> None:
    final = _stages()[target]
    users = _values(final, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    assert _values(final, "ENTRYPOINT") == ['["/usr/local/lib/samrollout/entrypoint.sh"]']
    assert "exec samrollout serve" in ENTRYPOINT.read_text()
    health = " ".join(_values(final, "HEALTHCHECK"))
    assert "healthcheck.py" in health and "--start-period=" in health
    assert _values(final, "VOLUME") == ['["/models"]']
    assert _values(final, "EXPOSE") == ["8000"]
    env = " ".join(_values(final, "ENV"))
    for setting in ("SAMROLLOUT_HOST=0.0.0.0", "SAMROLLOUT_PORT=8000", "SAMROLLOUT_CACHE=/models/cache"):
        assert setting in env


def test_ascend_image_loads_the_cann_environment_scripts() -> None:
    env = " ".join(_values(_stages()["ascend"], "ENV"))
    assert "/usr/local/Ascend/ascend-toolkit/set_env.sh" in env
    assert "/usr/local/Ascend/nnal/atb/set_env.sh" in env


def test_entrypoint_sources_the_cann_scripts_and_passes_arguments_to_samrollout_serve(tmp_path: Path) -> None:
    cann = tmp_path / "set_env.sh"
    cann.write_text(f'export SAMROLLOUT_TEST_CANN_LOADED=yes\necho "$UNSET_BY_CANN" > {tmp_path / "ran"}\n')
    env = {**os.environ, "SAMROLLOUT_CANN_ENV_SCRIPTS": f"{cann} {tmp_path / 'absent.sh'}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(ENTRYPOINT), "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--threshold-mode" in result.stdout  # samrollout serve's own help
    assert (tmp_path / "ran").exists()


def test_health_check_script_is_healthy_only_while_the_server_answers(tiny_server: Any) -> None:
    port = tiny_server.url.rsplit(":", 1)[1].rstrip("/")
    up = subprocess.run([sys.executable, str(HEALTHCHECK)], env={**os.environ, "SAMROLLOUT_PORT": port})
    assert up.returncode == 0
    from samrollout.testing import free_port

    down = subprocess.run([sys.executable, str(HEALTHCHECK)],
                          env={**os.environ, "SAMROLLOUT_PORT": str(free_port())})
    assert down.returncode == 1


def _dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for one path: a pattern matches the path or one of its parent directories."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        pattern = pattern.removeprefix("**/")
        if any(fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix.split("/")[-1], pattern)
               for prefix in prefixes):
            return True
    return False


def test_build_context_keeps_every_file_the_image_build_reads() -> None:
    patterns = _dockerignore_patterns()
    needed = ["pyproject.toml", "README.md", "service/csrc/CMakeLists.txt", "service/samrollout/__init__.py",
              "service/samrollout/server/app.py", "clients/pyproject.toml",
              "clients/samrollout_client/__init__.py"]
    for stage in _stages().values():
        for value in _values(stage, "COPY"):
            if "--from=" not in value:
                needed += [source for source in value.split()[:-1] if source != "."]
    for path in needed:
        assert (ROOT / path).exists(), f"{path} is missing"
        assert not _ignored(path, patterns), f".dockerignore drops {path}, which the build needs"
    assert _ignored(".git/HEAD", patterns) and _ignored("build/x/core.so", patterns)


# ------------------------------------------------------------------------------- compose


def _validate_compose(document: dict[str, Any]) -> None:
    """Validate against the Compose Specification's JSON schema (vendored by check-jsonschema)."""
    schema = get_builtin_schema("vendor.compose-spec")
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    validator(schema, format_checker=validator.FORMAT_CHECKER).validate(document)


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    _validate_compose(_compose())


def test_compose_specification_check_rejects_a_broken_file() -> None:
    """The schema check above has teeth: a misspelt key and a wrong type fail it."""
    broken = _compose()
    broken["services"]["samrollout"]["port"] = ["8000:8000"]
    with pytest.raises(jsonschema.ValidationError):
        _validate_compose(broken)
    broken = _compose()
    broken["services"]["samrollout"]["shm_size"] = {"size": "2gb"}
    with pytest.raises(jsonschema.ValidationError):
        _validate_compose(broken)


def test_compose_runs_the_cpu_image_prometheus_and_grafana_with_documented_ports() -> None:
    services = _compose()["services"]
    assert set(services) == {"samrollout", "prometheus", "grafana"}
    assert services["samrollout"]["build"] == {"context": ".", "target": "cpu"}
    assert "cpu" in _stages()
    ports = {name: [str(port).rsplit(":", 1)[1] for port in service["ports"]] for name, service in services.items()}
    assert ports == {"samrollout": ["8000"], "prometheus": ["9090"], "grafana": ["3000"]}
    assert "/models" in " ".join(services["samrollout"]["volumes"])
    page = (ROOT / "docs" / "deploy.md").read_text()
    for name, port in (("samrollout", "8000"), ("prometheus", "9090"), ("grafana", "3000")):
        assert f"| `{name}` | {port} |" in page


def test_compose_mounts_the_repo_prometheus_and_grafana_configuration() -> None:
    services = _compose()["services"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    prometheus_config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = prometheus_config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["samrollout:8000"], "Prometheus must scrape the compose service by its name"
    rule_files = prometheus_config["rule_files"]
    mounted = {volume.split(":")[1] for volume in services["prometheus"]["volumes"]}
    assert {f"/etc/prometheus/{rule}" for rule in rule_files} <= mounted
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/samrollout.yml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert any(volume.endswith(f":{dashboards_path}:ro") and volume.startswith("./deploy/grafana/dashboards")
               for volume in services["grafana"]["volumes"])
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/samrollout.json").read_text())
    assert dashboard["panels"]


def test_compose_passes_only_settings_the_server_knows() -> None:
    from samrollout.server.settings import ServerSettings

    environment = _compose()["services"]["samrollout"]["environment"]
    fields = {f"SAMROLLOUT_{name.upper()}" for name in ServerSettings.model_fields}
    assert set(environment) <= fields, set(environment) - fields


def test_compose_server_answers_to_the_name_prometheus_scrapes_it_by() -> None:
    from samrollout.server.api.request_gate import HostRule, parse_list

    allowed = _interpolate(_compose()["services"]["samrollout"]["environment"]["SAMROLLOUT_ALLOWED_HOSTS"], {})
    target = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"][0][
        "static_configs"][0]["targets"][0]
    assert HostRule("0.0.0.0", parse_list(allowed)).admits(target.split(":")[0]), (allowed, target)


def _interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's interpolation of ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` (unset or empty: error)."""
    def one(match: re.Match[str]) -> str:
        name, operator, rest = match.group(1), match.group(2), match.group(3) or ""
        current = environ.get(name, "")
        if operator == ":?" and not current:
            raise ValueError(f"required variable {name} is missing a value: {rest}")
        return current or (rest if operator == ":-" else "")

    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(?:(:-|:\?)([^}]*))?\}", one, value)


def _image_env(target: str) -> dict[str, str]:
    """The SAMROLLOUT_* variables an image target's ENV instructions set."""
    pairs = re.findall(r"(SAMROLLOUT_[A-Z_]+)=(\S+)", " ".join(_values(_stages()[target], "ENV")))
    return dict(pairs)


def test_compose_refuses_to_start_the_server_without_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The image listens on 0.0.0.0, where the server needs a key: compose demands one and says how to make it."""
    from pydantic import ValidationError

    from samrollout.server.settings import ServerSettings

    service = _compose()["services"]["samrollout"]
    required = r"\$\{SAMROLLOUT_API_KEY:\?.*openssl rand -hex 24.*\}"
    assert re.fullmatch(required, service["environment"]["SAMROLLOUT_API_KEY"])
    assert service["restart"] in ("unless-stopped", "on-failure", "always")
    for field in ServerSettings.model_fields:
        monkeypatch.delenv(f"SAMROLLOUT_{field.upper()}", raising=False)
    for name, value in _image_env("cpu").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="SAMROLLOUT_API_KEY is missing a value: set SAMROLLOUT_API_KEY"):
        {name: _interpolate(str(v), {}) for name, v in service["environment"].items()}
    environment = {name: _interpolate(str(v), {"SAMROLLOUT_API_KEY": "k" * 48})
                   for name, v in service["environment"].items()}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    settings = ServerSettings()
    assert settings.host == "0.0.0.0" and settings.api_key is not None
    monkeypatch.delenv("SAMROLLOUT_API_KEY")
    with pytest.raises(ValidationError, match="no --api-key is set"):
        ServerSettings()  # what the server itself would do with the image's settings and no key


def test_prometheus_scrapes_metrics_without_the_api_key() -> None:
    """/metrics stays open (only /v1 and /admin need the key), so the scrape config carries no credentials."""
    job = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert not {"authorization", "bearer_token", "bearer_token_file", "basic_auth"} & set(job)
