"""The Helm chart, deploy/helm/samrollout: it lints, renders valid Kubernetes objects, and does what its values say.

Rendered by Helm v4's own library (helm-python-sdk: no helm binary and no cluster needed),
with `strict` rendering (a template reading a value that does not exist fails) and schema
validation, as `helm install` does. Every rendered object is validated against the Kubernetes
OpenAPI schemas in strict mode (kubernetes-validate: an unknown or misspelt field fails), at
the oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the newest that
kubernetes-validate knows. The ServiceMonitor is a Prometheus Operator CRD, which those
schemas do not cover: it gets a structural check of its own here. Rendered manifests and the
repository's YAML are linted with yamllint (.yamllint.yaml).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from helm_python import _native
from yamllint import linter
from yamllint.cli import find_files_recursively
from yamllint.config import YamlLintConfig

from samrollout.drafter import DraftPolicy
from samrollout.server.api.request_gate import HostRule, parse_list
from samrollout.server.settings import ServerSettings, parse_peer_urls

ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = ROOT / "deploy" / "helm" / "samrollout"
EXAMPLES = {name: CHART_DIR / "ci" / f"{name}-values.yaml" for name in ("ascend", "cuda", "cpu")}
RELEASE, NAMESPACE = "rollout", "rl"
FULLNAME = f"{RELEASE}-samrollout"
PROMETHEUS_OPERATOR = "monitoring.coreos.com/v1"
# The oldest Kubernetes the chart supports (Chart.yaml: kubeVersion >=1.27) and the newest one
# kubernetes-validate has schemas for.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
ASCEND_DRIVER_PATHS = ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
                       "/etc/ascend_install.info")
# The key of renders that give none (`render`): the chart refuses to render without one.
RENDER_KEY: dict[str, Any] = {"apiKey": {"value": "render-key"}}
# Env vars the chart sets beside the server's settings: where the built-in model is converted,
# and the Hugging Face cache, both on the model volume.
NON_SETTING_ENV = {"SAMROLLOUT_CACHE", "HF_HOME"}
# The Prometheus Operator's duration pattern (ServiceMonitor CRD, endpoints[].interval).
PROMETHEUS_DURATION = re.compile(
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
SERVICE_MONITOR_ENDPOINT_FIELDS = {
    "port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
    "honorTimestamps", "relabelings", "metricRelabelings", "authorization", "bearerTokenSecret", "tlsConfig",
    "followRedirects", "enableHttp2", "filterRunning", "proxyUrl", "basicAuth", "oauth2", "trackTimestampsStaleness"}


# --- rendering -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """One rendered release: the text of every template and the Kubernetes objects in them."""

    files: dict[str, str]
    objects: list[dict[str, Any]]

    @property
    def notes(self) -> str:
        return self.files[f"{CHART_DIR.name}/templates/NOTES.txt"]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [obj for obj in self.all(kind) if name is None or obj["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
        return found[0]

    @property
    def workload(self) -> dict[str, Any]:
        workloads = self.all("Deployment") + self.all("StatefulSet")
        assert len(workloads) == 1, [w["kind"] for w in workloads]
        return workloads[0]

    @property
    def pod(self) -> dict[str, Any]:
        pod: dict[str, Any] = self.workload["spec"]["template"]["spec"]
        return pod

    @property
    def container(self) -> dict[str, Any]:
        containers = self.pod["containers"]
        assert [c["name"] for c in containers] == ["samrollout"]
        container: dict[str, Any] = containers[0]
        return container

    @property
    def env(self) -> dict[str, dict[str, Any]]:
        """The container's env vars by name (each name once)."""
        names = [var["name"] for var in self.container["env"]]
        assert len(names) == len(set(names)), f"duplicate env vars: {names}"
        return {var["name"]: var for var in self.container["env"]}

    def volume(self, name: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = [v for v in self.pod["volumes"] if v["name"] == name]
        assert len(found) == 1, f"volume {name}: {found}"
        return found[0]

    def mount(self, path: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = [m for m in self.container["volumeMounts"] if m["mountPath"] == path]
        assert len(found) == 1, f"mount {path}: {found}"
        return found[0]


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any] | None = None, *, prometheus_operator: bool = False,
           kube_version: str | None = None, keyless: bool = False) -> Release:
    """Render like `helm install rollout deploy/helm/samrollout -n rl` (offline), strictly.

    The chart needs an API key (it makes none up): values without ``apiKey`` get `RENDER_KEY`, unless ``keyless``.

    ``prometheus_operator``: the cluster serves monitoring.coreos.com/v1 (`--api-versions`).
    helm-python's `Chart.render` has no option for API versions or the Kubernetes version;
    the library's render call it wraps takes both, so it is called directly.
    """
    options: dict[str, Any] = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True, "strict": True}
    if not keyless and "apiKey" not in (values or {}):
        values = {**(values or {}), **RENDER_KEY}
    if prometheus_operator:
        options["api_versions"] = [PROMETHEUS_OPERATOR]
    if kube_version:
        options["kube_version"] = f"v{kube_version}"
    files: dict[str, str] = json.loads(_native.call_string(
        "helm_render", chart._raw(), json.dumps(values or {}), json.dumps(options)))
    objects = [obj for path, text in sorted(files.items()) if path.endswith(".yaml")
               for obj in yaml.safe_load_all(text) if obj]
    return Release(files, objects)


def example(name: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(EXAMPLES[name].read_text())
    return values


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` deep-merged over ``base`` (maps merge, everything else replaces), as Helm merges -f files."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# Values that between them take every branch of the templates.
SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "ascend-example": example("ascend"),
    "cuda-example": example("cuda"),
    "cpu-example": example("cpu"),
    "statefulset-hpa-chart-secret": {
        "workload": {"kind": "StatefulSet"}, "autoscaling": {"enabled": True}, "apiKey": {"value": "k"},
        "podAntiAffinity": "soft", "modelVolume": {"persistentVolumeClaim": {"storageClassName": ""}},
        "podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"},
        "server": {"vllmArgs": ["--enable-sleep-mode"], "k": 4, "logLevel": "debug"}},
    "cuda-hostpath-pinned": {
        "backend": "cuda", "backends": {"cuda": {"visibleDevices": "0,1"}}, "acceleratorCount": 2,
        "modelVolume": {"type": "hostPath"}, "shm": {"enabled": False}, "weightStaging": {"emptyDir": False},
        "serviceAccount": {"create": False},
        "grafanaDashboard": {"enabled": False}, "image": {"digest": "sha256:" + "a" * 64},
        "extraEnv": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
        "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
    "areal-trainer": {
        "server": {"arealRoutes": True, "arealPort": 8001, "weightsRoot": "/models/checkpoints"},
        "arealTrainer": {"podSelector": {"app": "areal-trainer"}, "namespaceSelector": {"team": "rl"}},
        "workload": {"kind": "StatefulSet"}},
    "cpu-emptydir-no-probes": {
        "backend": "cpu", "modelVolume": {"type": "emptyDir", "emptyDir": {"sizeLimit": ""}},
        "server": {"weightStagingDir": "/scratch/weights"}, "weightStaging": {"sizeLimit": "40Gi"},
        "probes": {"liveness": {"enabled": False}}, "podDisruptionBudget": {"enabled": False},
        "terminationGracePeriodSeconds": 120, "service": {"type": "NodePort"}},
}


# --- the chart as a whole -------------------------------------------------------------------------------------


def test_chart_metadata_and_app_version_match_the_project() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["apiVersion"] == "v2" and meta["name"] == "samrollout" and meta["type"] == "application"
    assert meta["appVersion"] == project["version"]


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=["defaults", *EXAMPLES])
def test_helm_lint_passes_in_strict_mode(values: str | None) -> None:
    report = helm.lint(CHART_DIR, merged(RENDER_KEY, example(values) if values else {}), strict=True,
                       namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSIONS[0]}")
    # Severity 1 is information (Chart.yaml has no icon); 2 (warning) and 3 (error) fail.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(
        chart: helm.Chart, scenario: str, kube_version: str) -> None:
    release = render(chart, SCENARIOS[scenario], prometheus_operator=True, kube_version=kube_version)
    assert release.objects
    for obj in release.objects:
        if obj["apiVersion"] == PROMETHEUS_OPERATOR:
            continue  # a CRD: see test_service_monitor_scrapes_metrics_of_the_api_service
        assert obj["metadata"]["namespace"] == NAMESPACE
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {error.message} at {list(error.path)}")


def _rendered_yaml_config() -> YamlLintConfig:
    """The repository's yamllint rules, less line-length: the dashboard ConfigMap holds generated JSON."""
    return YamlLintConfig(f"extends: {ROOT / '.yamllint.yaml'}\nrules:\n  line-length: disable\n")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_manifests_pass_yamllint(chart: helm.Chart, scenario: str) -> None:
    config = _rendered_yaml_config()
    release = render(chart, SCENARIOS[scenario], prometheus_operator=True)
    problems = []
    for path, text in release.files.items():
        if not path.endswith(".yaml") or not text.strip():
            continue
        # Helm trims each template's output before writing it out; the rest is ours.
        problems += [f"{path}:{p.line}: {p.desc} ({p.rule})"
                     for p in linter.run(text.strip() + "\n", config, path)]
    assert not problems, "\n".join(problems)


def test_repository_yaml_passes_yamllint(monkeypatch: pytest.MonkeyPatch) -> None:
    """`yamllint .` at the root passes (its ignore patterns are relative to the root)."""
    monkeypatch.chdir(ROOT)
    config = YamlLintConfig(file=".yamllint.yaml")
    files = sorted(ROOT / f for f in find_files_recursively(["."], config))
    assert CHART_DIR / "values.yaml" in files and EXAMPLES["ascend"] in files
    assert ROOT / "deploy" / "prometheus" / "rules.yml" in files
    assert not [f for f in files if "templates" in f.parts], "Helm templates are not plain YAML"
    problems = [f"{f.relative_to(ROOT)}:{p.line}: {p.desc} ({p.rule})"
                for f in files for p in linter.run(f.read_text(), config, str(f.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)


def test_every_value_is_documented_and_in_the_schema(chart: helm.Chart) -> None:
    """Each value in values.yaml has a comment right above it (or beside it) and a place in values.schema.json.

    A value is a key whose schema is not a section (an object with its own listed properties):
    a scalar, a list, or a free-form map such as nodeSelector.
    """
    schema = chart.schema
    assert schema is not None
    definitions = schema["definitions"]
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = definitions[node["$ref"].rsplit("/", 1)[1]]
        return node

    undocumented: list[str] = []

    def walk(mapping: yaml.MappingNode, section: dict[str, Any], prefix: str) -> None:
        for key_node, value_node in mapping.value:
            key = f"{prefix}{key_node.value}"
            assert key_node.value in section.get("properties", {}), f"{key} is not in values.schema.json"
            sub = resolve(section["properties"][key_node.value])
            if "properties" in sub and isinstance(value_node, yaml.MappingNode):
                walk(value_node, sub, f"{key}.")
                continue
            line = key_node.start_mark.line
            if not (lines[line - 1].strip().startswith("#") or "#" in lines[line]):
                undocumented.append(f"values.yaml:{line + 1}: {key}")

    root = yaml.compose((CHART_DIR / "values.yaml").read_text())
    assert isinstance(root, yaml.MappingNode)
    walk(root, schema, "")
    assert not undocumented, "values without a comment:\n" + "\n".join(undocumented)


# --- server settings --------------------------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _sample(prop: dict[str, Any]) -> Any:
    """A value the chart's schema accepts for a server setting, not its default and not null."""
    types = prop.get("type", [])
    types = [types] if isinstance(types, str) else types
    if "enum" in prop:
        return next(v for v in reversed(prop["enum"]) if v is not None)
    if "examples" in prop:  # a string the schema constrains by a pattern
        return prop["examples"][0]
    if "boolean" in types:
        return False
    if "integer" in types:
        # Past 1e6, so that a number Helm holds as a float must still come out as an integer.
        return prop.get("maximum", 1_048_576)
    if "number" in types:
        return 0.5
    if "array" in types:
        return ["--enforce-eager"]
    if "object" in types:
        return {"min_match_length": 2, "source": "own"}
    return "/models/sample-7b"


def _server_schema(chart: helm.Chart) -> dict[str, Any]:
    schema = chart.schema
    assert schema is not None
    server: dict[str, Any] = schema["properties"]["server"]["properties"]
    return server


def _environ(release: Release) -> dict[str, str]:
    """The container's env as the process sees it (secretKeyRefs resolved from the rendered Secrets)."""
    secrets = {s["metadata"]["name"]: s["data"] for s in release.all("Secret")}
    environ = {}
    for name, var in release.env.items():
        if "value" in var:
            environ[name] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            environ[name] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
    return environ


def _every_setting(chart: helm.Chart) -> dict[str, Any]:
    """A sample value for every server setting (`_sample`), AReaL's routes on with a port of their own (the chart
    and the server refuse an AReaL port without them)."""
    everything = {name: _sample(prop) for name, prop in _server_schema(chart).items()}
    # The sample peers are plain http: with the chart's key, the chart and the server refuse them unless allowed.
    return {**everything, "arealRoutes": True, "arealPort": 9001, "allowPlainHttpPeers": True}


TRAINER = {"podSelector": {"app": "areal-trainer"}}


def test_every_server_setting_is_reachable_from_values(chart: helm.Chart) -> None:
    """Each ServerSettings field has a chart value that sets its SAMROLLOUT_* variable (api_key through a Secret;
    api_key_file, the key as a file, has none: the chart gives the key from its Secret).

    A new server setting without a chart value (values.yaml, values.schema.json) fails here.
    """
    fields = set(ServerSettings.model_fields) - {"api_key_file"}
    schema = _server_schema(chart)
    defaults = chart.values
    assert {_camel(f) for f in fields - {"api_key"}} == set(schema), "values.schema.json server.* != ServerSettings"
    assert set(schema) <= set(defaults["server"]) | {k for k, v in schema.items() if "null" in v.get("type", [])}
    everything = _every_setting(chart)
    release = render(chart, {"server": everything, "apiKey": {"value": "sample-key"}, "arealTrainer": TRAINER})
    set_by_chart = {name for name in release.env if name.startswith("SAMROLLOUT_")} - NON_SETTING_ENV
    assert set_by_chart == {f"SAMROLLOUT_{field.upper()}" for field in fields}


def test_server_reads_the_settings_the_chart_sets(chart: helm.Chart, monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's environment, parsed by the server's own ServerSettings, is exactly what the values say."""
    everything = _every_setting(chart)
    release = render(chart, {"server": everything, "apiKey": {"value": "sample-key"}, "arealTrainer": TRAINER})
    environ = _environ(release)
    assert environ["SAMROLLOUT_MAX_MODEL_LEN"] == "1048576" and environ["SAMROLLOUT_VLLM_ARGS"] == '["--enforce-eager"]'
    monkeypatch.delenv("SAMROLLOUT_CACHE", raising=False)
    for field in ServerSettings.model_fields:
        monkeypatch.delenv(f"SAMROLLOUT_{field.upper()}", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    settings = ServerSettings()
    for field in ServerSettings.model_fields:
        if field == "api_key":
            assert settings.api_key is not None and settings.api_key.get_secret_value() == "sample-key"
        elif field == "api_key_file":
            assert settings.api_key_file is None
        else:
            assert getattr(settings, field) == everything[_camel(field)], field


def test_default_values_run_the_server_with_its_own_defaults(chart: helm.Chart,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    release = render(chart)
    environ = _environ(release)
    assert {n for n in environ if n.startswith("SAMROLLOUT_")} - NON_SETTING_ENV == {
        "SAMROLLOUT_HOST", "SAMROLLOUT_PORT", "SAMROLLOUT_TENSOR_PARALLEL_SIZE", "SAMROLLOUT_API_KEY",
        "SAMROLLOUT_WEIGHT_PEERS",  # the pods of the headless service (weightFanOut), plain http:
        "SAMROLLOUT_ALLOW_PLAIN_HTTP_PEERS",  # allowed explicitly (the chart has no TLS)
        "SAMROLLOUT_WEIGHT_STAGING_DIR",  # a 0700 folder the server makes in the staging emptyDir
        "SAMROLLOUT_ALLOWED_HOSTS"}  # the names of the chart's services (the Host check)
    for field in ServerSettings.model_fields:
        monkeypatch.delenv(f"SAMROLLOUT_{field.upper()}", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    settings = ServerSettings()  # on 0.0.0.0 the server refuses to start without a key: the chart's is there
    assert settings.host == "0.0.0.0" and settings.port == 8000 and settings.tensor_parallel_size == 1
    assert settings.model is None and settings.api_key is not None  # the built-in model, the release's key
    assert not settings.allow_unauthenticated_admin
    assert environ["SAMROLLOUT_CACHE"] == "/models/cache" and environ["HF_HOME"] == "/models/huggingface"


def _bounds(prop: dict[str, Any]) -> dict[str, Any]:
    """The range and choices a JSON schema property allows (nullability and descriptions aside)."""
    branches = prop.get("anyOf", [prop])
    out: dict[str, Any] = {}
    for branch in branches:
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in branch:
                out[key] = branch[key]
        if "enum" in branch:
            out["enum"] = sorted(v for v in branch["enum"] if v is not None)
        types = branch.get("type", [])
        for t in [types] if isinstance(types, str) else types:
            if t != "null":
                out["type"] = t
    return out


def test_values_schema_ranges_match_server_settings(chart: helm.Chart) -> None:
    """values.schema.json fails at install time exactly what the server would refuse at start-up."""
    pydantic_schema = ServerSettings.model_json_schema()["properties"]
    chart_schema = _server_schema(chart)
    # A container port cannot be 0 (the server's "any free port").
    chart_only = {"port": {"minimum": 1}}
    for field, prop in pydantic_schema.items():
        if field in ("api_key", "api_key_file"):  # the key comes from a Secret (apiKey)
            continue
        expected = {**_bounds(prop), **chart_only.get(field, {})}
        assert _bounds(chart_schema[_camel(field)]) == expected, field


def test_draft_policy_values_are_draft_policy_fields(chart: helm.Chart) -> None:
    """draftPolicy's fields are checked from DraftPolicy itself (the server does at start-up), not listed again
    in the schema: every draftPolicy the chart sets (values.yaml, the ci examples) or shows (values.yaml's
    comment) is made of DraftPolicy fields, with values DraftPolicy accepts."""
    prop = _server_schema(chart)["draftPolicy"]
    assert prop["type"] == "object" and prop.get("additionalProperties") is True and "properties" not in prop
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("draftPolicy:"))
    comment = []
    while lines[at - 1 - len(comment)].strip().startswith("#"):
        comment.insert(0, lines[at - 1 - len(comment)].strip().lstrip("#"))
    shown = re.findall(r"\{[^{}]*\}", " ".join(comment))
    assert shown, "values.yaml's draftPolicy comment shows no example"
    policies = {"values.yaml": chart.values["server"]["draftPolicy"],
                **{f"ci/{name}-values.yaml": example(name).get("server", {}).get("draftPolicy", {})
                   for name in EXAMPLES},
                **{f"values.yaml's comment, {text}": yaml.safe_load(text) for text in shown}}
    known = {knob.name for knob in fields(DraftPolicy)}
    for where, policy in policies.items():
        assert set(policy) <= known, f"{where}: {sorted(set(policy) - known)} are not DraftPolicy fields"
        DraftPolicy.from_dict(policy)  # and the server would accept their values


# --- accelerators -----------------------------------------------------------------------------------------------


def test_ascend_render_requests_npus_mounts_the_driver_and_targets_npu_nodes(chart: helm.Chart) -> None:
    release = render(chart, example("ascend"))
    resources = release.container["resources"]
    # tensorParallelSize 4 in the example: one NPU per tensor-parallel rank.
    assert resources["limits"]["huawei.com/Ascend910"] == 4 and resources["requests"]["huawei.com/Ascend910"] == 4
    assert release.container["image"] == "samrollout:ascend"
    for path in ASCEND_DRIVER_PATHS:
        mount = release.mount(path)
        assert mount["readOnly"] is True
        assert release.volume(mount["name"])["hostPath"]["path"] == path
    assert release.pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert {"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"} in release.pod["tolerations"]
    # The device plugin sets the visible devices when it allocates; the chart does not, unless pinned.
    assert "ASCEND_RT_VISIBLE_DEVICES" not in release.env
    pinned = render(chart, merged(example("ascend"), {"backends": {"ascend": {"visibleDevices": "0,1,2,3"}}}))
    assert pinned.env["ASCEND_RT_VISIBLE_DEVICES"]["value"] == "0,1,2,3"
    # vllm-ascend images run as root, and the driver files need it.
    assert release.pod["securityContext"]["runAsUser"] == 0
    assert release.container["securityContext"]["allowPrivilegeEscalation"] is False
    assert "privileged" not in release.container["securityContext"]


def test_ascend_resource_name_and_driver_mounts_are_configurable(chart: helm.Chart) -> None:
    mounts = [{"name": "ascend-driver", "hostPath": "/opt/ascend/driver", "mountPath": "/usr/local/Ascend/driver"}]
    release = render(chart, {"backends": {"ascend": {
        "resourceName": "huawei.com/Ascend910-4c", "hostMounts": mounts,
        "nodeSelector": {"accelerator": None, "node.kubernetes.io/npu": "910b"}}}})
    assert release.container["resources"]["limits"] == {"huawei.com/Ascend910-4c": 1}
    assert release.volume("ascend-driver")["hostPath"] == {"path": "/opt/ascend/driver"}
    assert release.mount("/usr/local/Ascend/driver")["readOnly"] is True
    assert not [m for m in release.container["volumeMounts"] if m["mountPath"] == "/usr/local/dcmi"]
    assert release.pod["nodeSelector"] == {"node.kubernetes.io/npu": "910b"}
    # Cluster-specific placement adds to the backend's.
    extra = {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
    placed = render(chart, {"nodeSelector": {"pool": "rl"}, "tolerations": [extra], "schedulerName": "volcano"})
    assert placed.pod["nodeSelector"] == {"accelerator": "huawei-Ascend910", "pool": "rl"}
    assert extra in placed.pod["tolerations"] and len(placed.pod["tolerations"]) == 2
    assert placed.pod["schedulerName"] == "volcano"


def test_cuda_render_requests_gpus_and_runs_as_the_image_user(chart: helm.Chart) -> None:
    release = render(chart, example("cuda"))
    resources = release.container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 2 and resources["requests"]["nvidia.com/gpu"] == 2
    assert not any(name.startswith("huawei.com/") for name in resources["limits"])
    assert release.container["image"] == "samrollout:cuda"
    assert not [v for v in release.pod["volumes"] if "hostPath" in v]  # the container toolkit injects the driver
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in release.pod["tolerations"]
    security = release.pod["securityContext"]
    assert security["runAsUser"] == 1000 and security["runAsNonRoot"] is True and security["fsGroup"] == 1000
    assert release.container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_cpu_render_requests_no_accelerator(chart: helm.Chart) -> None:
    release = render(chart, example("cpu"))
    resources = release.container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"} and set(resources["limits"]) == {"memory"}
    assert release.container["image"] == "samrollout:cpu" and "nodeSelector" not in release.pod


def test_accelerator_count_follows_tensor_parallel_size(chart: helm.Chart) -> None:
    for backend, resource in (("ascend", "huawei.com/Ascend910"), ("cuda", "nvidia.com/gpu")):
        release = render(chart, {"backend": backend, "server": {"tensorParallelSize": 8}})
        assert release.container["resources"]["limits"][resource] == 8
        assert render(chart, {"backend": backend, "acceleratorCount": 2}).container["resources"]["limits"] == {
            resource: 2}
    with pytest.raises(helm.HelmRenderError, match=r"below server\.tensorParallelSize"):
        render(chart, {"acceleratorCount": 2, "server": {"tensorParallelSize": 4}})


# --- volumes, probes, Service -----------------------------------------------------------------------------------


def test_shared_memory_is_a_memory_backed_volume_at_dev_shm(chart: helm.Chart) -> None:
    release = render(chart, {"shm": {"sizeLimit": "24Gi"}})
    shm = release.volume(release.mount("/dev/shm")["name"])
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "24Gi"}
    assert not [m for m in render(chart, {"shm": {"enabled": False}}).container["volumeMounts"]
                if m["mountPath"] == "/dev/shm"]


def test_model_volume_holds_the_model_cache(chart: helm.Chart) -> None:
    # Default: a claim the chart creates, kept on uninstall.
    release = render(chart)
    claim = release.one("PersistentVolumeClaim", f"{FULLNAME}-models")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi" and "storageClassName" not in claim["spec"]
    assert release.volume("models")["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert release.mount("/models")["name"] == "models"
    assert release.env["SAMROLLOUT_CACHE"]["value"] == "/models/cache"
    # An existing claim: used as is, nothing created.
    existing = render(chart, {"modelVolume": {"persistentVolumeClaim": {"existingClaim": "models"}}})
    assert not existing.all("PersistentVolumeClaim")
    assert existing.volume("models")["persistentVolumeClaim"]["claimName"] == "models"
    # StatefulSet: one claim per pod.
    stateful = render(chart, {"workload": {"kind": "StatefulSet"}})
    assert not stateful.all("PersistentVolumeClaim") and "models" not in [v["name"] for v in stateful.pod["volumes"]]
    template = stateful.workload["spec"]["volumeClaimTemplates"][0]
    assert template["metadata"]["name"] == "models" and template["spec"]["accessModes"] == ["ReadWriteOnce"]
    # A node directory, or scratch space.
    host = render(chart, {"modelVolume": {"type": "hostPath", "mountPath": "/data",
                                          "hostPath": {"path": "/mnt/models"}}})
    assert host.volume("models")["hostPath"] == {"path": "/mnt/models", "type": "DirectoryOrCreate"}
    assert host.env["SAMROLLOUT_CACHE"]["value"] == "/data/cache" and host.mount("/data")["name"] == "models"
    scratch = render(chart, {"modelVolume": {"type": "emptyDir"}})
    assert scratch.volume("models")["emptyDir"] == {"sizeLimit": "50Gi"} and not scratch.all("PersistentVolumeClaim")


def test_pushed_weights_are_staged_in_a_folder_the_server_makes_private_inside_an_emptydir(chart: helm.Chart) -> None:
    """An emptyDir is open to every user, which the server refuses as its staging folder: the emptyDir is mounted
    at a parent, and the staging folder inside it is the server's own (created 0700 at start)."""
    release = render(chart)
    assert release.volume(release.mount("/staging")["name"])["emptyDir"] == {}
    assert release.env["SAMROLLOUT_WEIGHT_STAGING_DIR"]["value"] == "/staging/weight-uploads"
    # A staging dir of one's own: the emptyDir is mounted at its parent, with a size limit.
    placed = render(chart, {"server": {"weightStagingDir": "/scratch/weights"}, "weightStaging": {"sizeLimit": "40Gi"}})
    assert placed.env["SAMROLLOUT_WEIGHT_STAGING_DIR"]["value"] == "/scratch/weights"
    assert placed.volume(placed.mount("/scratch")["name"])["emptyDir"] == {"sizeLimit": "40Gi"}
    assert "/scratch/weights" not in [mount["mountPath"] for mount in placed.container["volumeMounts"]]
    with pytest.raises(helm.HelmError, match="mounted at its parent directory, here /"):
        render(chart, {"server": {"weightStagingDir": "/weights"}})
    # Off: the server's default, under SAMROLLOUT_CACHE on the model volume.
    off = render(chart, {"weightStaging": {"emptyDir": False}})
    assert "weight-staging" not in [v["name"] for v in off.pod["volumes"]]
    assert "SAMROLLOUT_WEIGHT_STAGING_DIR" not in off.env


def test_probes_check_health_and_allow_a_long_model_load(chart: helm.Chart) -> None:
    container = render(chart).container
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["httpGet"] == {"path": "/health", "port": "http"}, kind
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    longer = render(chart, {"probes": {"startup": {"failureThreshold": 360}}}).container["startupProbe"]
    assert longer["periodSeconds"] * longer["failureThreshold"] == 60 * 60


def test_service_routes_port_http_to_the_server_pods(chart: helm.Chart) -> None:
    release = render(chart, {"server": {"port": 9000}})
    service = release.one("Service", FULLNAME)
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}]
    assert release.container["ports"][0]["containerPort"] == 9000
    assert release.env["SAMROLLOUT_PORT"]["value"] == "9000"
    pod_labels = release.workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert release.workload["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_pod_disruption_budget_covers_the_server_pods(chart: helm.Chart) -> None:
    release = render(chart)
    budget = release.one("PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1 and budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budget["spec"]["selector"]["matchLabels"].items() <= \
        release.workload["spec"]["template"]["metadata"]["labels"].items()
    floor = render(chart, {"podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"}})
    assert floor.one("PodDisruptionBudget")["spec"]["minAvailable"] == "50%"
    assert not render(chart, {"podDisruptionBudget": {"enabled": False}}).all("PodDisruptionBudget")


def test_termination_grace_outlasts_the_server_shutdown_timeout(chart: helm.Chart) -> None:
    assert render(chart).pod["terminationGracePeriodSeconds"] == 60  # 30 s default + 30 s
    assert render(chart, {"server": {"shutdownTimeout": 90.5}}).pod["terminationGracePeriodSeconds"] == 121
    assert render(chart, {"terminationGracePeriodSeconds": 300}).pod["terminationGracePeriodSeconds"] == 300


def test_the_server_answers_to_the_names_of_the_charts_services(chart: helm.Chart) -> None:
    """The Host check (SAMROLLOUT_ALLOWED_HOSTS) admits the chart's services and their pods by any cluster name."""
    release = render(chart)
    rule = HostRule("0.0.0.0", parse_list(release.env["SAMROLLOUT_ALLOWED_HOSTS"]["value"]))
    for name in (FULLNAME, f"{FULLNAME}.{NAMESPACE}", f"{FULLNAME}.{NAMESPACE}.svc.cluster.local",
                 f"{FULLNAME}-headless.{NAMESPACE}.svc", f"{FULLNAME}-0.{FULLNAME}-headless.{NAMESPACE}.svc"):
        assert rule.admits(name), name
    assert not rule.admits("evil.example") and not rule.admits(f"{FULLNAME}.evil.example")
    own = render(chart, {"server": {"allowedHosts": "rollout.example.com"}})
    assert own.env["SAMROLLOUT_ALLOWED_HOSTS"]["value"] == "rollout.example.com"  # set by hand: kept


def test_pods_are_each_others_weight_peers_through_a_headless_service(chart: helm.Chart) -> None:
    """weightFanOut: a name resolving to every pod (ready or not), given to each as --weight-peers."""
    for kind in ("Deployment", "StatefulSet"):
        release = render(chart, {"workload": {"kind": kind}, "server": {"port": 9000}})
        headless = release.one("Service", f"{FULLNAME}-headless")
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
        pod_labels = release.workload["spec"]["template"]["metadata"]["labels"]
        assert headless["spec"]["selector"].items() <= pod_labels.items()
        peers = release.env["SAMROLLOUT_WEIGHT_PEERS"]["value"]
        assert peers == f"http://{FULLNAME}-headless.{NAMESPACE}.svc:9000"
        assert parse_peer_urls(peers) == [peers]
    own = render(chart, {"server": {"weightPeers": "http://a:8000,http://b:8000", "allowPlainHttpPeers": True}})
    assert own.env["SAMROLLOUT_WEIGHT_PEERS"]["value"] == "http://a:8000,http://b:8000"  # set by hand: kept
    off = render(chart, {"weightFanOut": {"enabled": False}})
    assert "SAMROLLOUT_WEIGHT_PEERS" not in off.env
    assert [service["metadata"]["name"] for service in off.all("Service")] == [FULLNAME]


def test_areal_routes_keep_the_key_and_open_the_trainers_port_to_the_trainers_pods_only(
        chart: helm.Chart, monkeypatch: pytest.MonkeyPatch) -> None:
    """server.arealRoutes with a key: the key is kept (Secret, variable, restart on change); AReaL's port is a
    container port of its own, which a NetworkPolicy admits from the trainer's pods only while the API port stays
    open (behind the key); the server's own settings accept what the chart sets; the notes say how AReaL connects."""
    values = {"server": {"arealRoutes": True, "arealPort": 8001, "weightsRoot": "/models/checkpoints"},
              "apiKey": {"value": "kept"}, "arealTrainer": {"podSelector": {"app": "areal-trainer"}}}
    release = render(chart, values)
    environ = _environ(release)
    assert environ["SAMROLLOUT_API_KEY"] == "kept" and release.one("Secret", f"{FULLNAME}-api-key")
    assert "SAMROLLOUT_ALLOW_UNAUTHENTICATED_ADMIN" not in environ
    assert "checksum/api-key" in release.workload["spec"]["template"]["metadata"]["annotations"]
    assert environ["SAMROLLOUT_AREAL_ROUTES"] == "true" and environ["SAMROLLOUT_AREAL_PORT"] == "8001"
    assert {"name": "areal", "containerPort": 8001, "protocol": "TCP"} in release.container["ports"]
    policy = release.one("NetworkPolicy", f"{FULLNAME}-areal-trainer")["spec"]
    pod_labels = release.workload["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items() and policy["policyTypes"] == ["Ingress"]
    api, trainer = policy["ingress"]
    assert api == {"ports": [{"port": "http", "protocol": "TCP"}]}  # from anywhere: behind the key
    assert trainer == {"from": [{"podSelector": {"matchLabels": {"app": "areal-trainer"}}}],
                       "ports": [{"port": "areal", "protocol": "TCP"}]}
    other_namespace = render(chart, merged(values, {"arealTrainer": {"namespaceSelector": {"team": "rl"}}}))
    [source] = other_namespace.one("NetworkPolicy")["spec"]["ingress"][1]["from"]
    assert source["namespaceSelector"] == {"matchLabels": {"team": "rl"}}
    for field in ServerSettings.model_fields:
        monkeypatch.delenv(f"SAMROLLOUT_{field.upper()}", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    settings = ServerSettings()
    assert settings.areal_routes and settings.api_key is not None and settings.areal_port == 8001
    assert settings.weights_root == "/models/checkpoints" and not settings.allow_unauthenticated_admin
    assert "AReaL sends no API key: it connects to port areal" in release.notes and "NetworkPolicy" in release.notes
    assert not render(chart).all("NetworkPolicy")


AREAL_MISTAKES = {
    "no port of its own": ({"server": {"arealRoutes": True, "weightsRoot": "/ckpt"}, "arealTrainer": TRAINER},
                           "server.arealRoutes needs server.arealPort"),
    "the API port": ({"server": {"arealRoutes": True, "arealPort": 8000, "weightsRoot": "/ckpt"},
                      "arealTrainer": TRAINER}, "server.arealPort (8000) is server.port"),
    "no trainer selector": ({"server": {"arealRoutes": True, "arealPort": 8001, "weightsRoot": "/ckpt"}},
                            "needs arealTrainer.podSelector"),
    "no weights root": ({"server": {"arealRoutes": True, "arealPort": 8001}, "arealTrainer": TRAINER},
                        "needs server.weightsRoot"),
    "a port without the routes": ({"server": {"arealPort": 8001}}, "set server.arealRoutes too"),
}


@pytest.mark.parametrize("case", AREAL_MISTAKES)
def test_areal_settings_that_cannot_work_fail_the_render_saying_what_to_set(chart: helm.Chart, case: str) -> None:
    values, says = AREAL_MISTAKES[case]
    with pytest.raises(helm.HelmError) as failed:
        render(chart, values)
    assert says in str(failed.value)
    allowed = merged(values, {"server": {"allowAnyWeightsPath": True}})
    if case == "no weights root":
        assert render(chart, allowed).one("NetworkPolicy")  # the documented opt-out


def test_statefulset_mode_runs_one_pod_per_node(chart: helm.Chart) -> None:
    release = render(chart, example("ascend"))
    workload = release.workload
    assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] == 2
    headless = release.one("Service", workload["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    terms = release.pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["topologyKey"] == "kubernetes.io/hostname"
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert terms[0]["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    assert render(chart).workload["kind"] == "Deployment"


# --- API key ----------------------------------------------------------------------------------------------------


def test_api_key_comes_from_a_secret(chart: helm.Chart) -> None:
    # An existing Secret: referenced, never copied into the release.
    release = render(chart, {"apiKey": {"existingSecret": "trainer-key", "secretKey": "token"}})
    assert release.env["SAMROLLOUT_API_KEY"] == {
        "name": "SAMROLLOUT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "trainer-key", "key": "token"}}}
    assert not release.all("Secret")
    assert "get secret trainer-key -o jsonpath='{.data.token}'" in release.notes
    # A key given as a value: the chart's own Secret, and the pods restart when it changes.
    release = render(chart, {"apiKey": {"value": "s3cret-value"}})
    secret = release.one("Secret", f"{FULLNAME}-api-key")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cret-value"
    assert release.env["SAMROLLOUT_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULLNAME}-api-key", "key": "api-key"}
    assert not [path for path, text in release.files.items() if "s3cret-value" in text]
    checksum = release.workload["spec"]["template"]["metadata"]["annotations"]["checksum/api-key"]
    rotated = render(chart, {"apiKey": {"value": "rotated"}})
    assert rotated.workload["spec"]["template"]["metadata"]["annotations"]["checksum/api-key"] != checksum
    assert "Authorization: Bearer $SAMROLLOUT_API_KEY" in release.notes


def test_every_render_gives_the_same_key_and_none_is_made_up(chart: helm.Chart) -> None:
    """GitOps (`helm template` on every sync): two renders of the same values give the same key reference and the
    same key; an existing Secret is used as is; with no key given the render fails saying what to set, never a new
    random key per render (pods and clients would disagree)."""
    given = {"apiKey": {"existingSecret": "trainer-key", "secretKey": "token"}}
    first, second = render(chart, given), render(chart, given)
    assert first.env["SAMROLLOUT_API_KEY"] == second.env["SAMROLLOUT_API_KEY"] == {
        "name": "SAMROLLOUT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "trainer-key", "key": "token"}}}
    assert not first.all("Secret") and not second.all("Secret")  # used as is: never copied, never replaced
    by_value = {"apiKey": {"value": "stable-key"}}
    one, two = (render(chart, by_value).one("Secret", f"{FULLNAME}-api-key") for _ in range(2))
    assert one == two and base64.b64decode(one["data"]["api-key"]).decode() == "stable-key"
    for _ in range(2):
        with pytest.raises(helm.HelmError) as refused:
            render(chart, keyless=True)
        message = str(refused.value)
        assert "apiKey.existingSecret" in message and "apiKey.value" in message, message
        assert "helm template" in message and "kubectl create secret generic" in message, message


def test_the_charts_plain_http_peers_are_allowed_explicitly_and_hand_given_ones_need_it(
        chart: helm.Chart, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart has no TLS, so its peers (the headless service) are plain http: it sets --allow-plain-http-peers
    for them, and the server's own settings accept the result; http:// peers given by hand fail the render unless
    server.allowPlainHttpPeers, https:// ones need nothing."""
    release = render(chart)
    assert release.env["SAMROLLOUT_WEIGHT_PEERS"]["value"].startswith("http://")
    assert release.env["SAMROLLOUT_ALLOW_PLAIN_HTTP_PEERS"]["value"] == "true"
    for field in ServerSettings.model_fields:
        monkeypatch.delenv(f"SAMROLLOUT_{field.upper()}", raising=False)
    for name, value in _environ(release).items():
        monkeypatch.setenv(name, value)
    assert ServerSettings().allow_plain_http_peers
    monkeypatch.delenv("SAMROLLOUT_ALLOW_PLAIN_HTTP_PEERS")
    with pytest.raises(ValueError, match="plain http:// beyond loopback"):
        ServerSettings()  # what the server would say without it
    with pytest.raises(helm.HelmError, match=r"server\.allowPlainHttpPeers: true"):
        render(chart, {"server": {"weightPeers": "http://a:8000"}})
    allowed = render(chart, {"server": {"weightPeers": "http://a:8000", "allowPlainHttpPeers": True}})
    assert allowed.env["SAMROLLOUT_ALLOW_PLAIN_HTTP_PEERS"]["value"] == "true"
    tls = render(chart, {"server": {"weightPeers": "https://a:8443,https://b:8443"}})
    assert "SAMROLLOUT_ALLOW_PLAIN_HTTP_PEERS" not in tls.env
    with pytest.raises(helm.HelmError, match="allowPlainHttpPeers: false refuses"):
        render(chart, {"server": {"allowPlainHttpPeers": False}})
    assert "SAMROLLOUT_ALLOW_PLAIN_HTTP_PEERS" not in render(chart, {"weightFanOut": {"enabled": False}}).env


def test_notes_tell_how_to_reach_the_api_and_the_dashboard(chart: helm.Chart) -> None:
    notes = render(chart, {"apiKey": {"value": "k"}, "server": {"servedModelName": "policy"}},
                   prometheus_operator=True).notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/{FULLNAME} 8000:8000" in notes
    assert f"http://{FULLNAME}.{NAMESPACE}.svc.cluster.local:8000/v1" in notes
    assert f"get secret {FULLNAME}-api-key -o jsonpath='{{.data.api-key}}' | base64 -d" in notes
    assert 'Authorization: Bearer $SAMROLLOUT_API_KEY' in notes and '"model": "policy"' in notes
    assert f"ServiceMonitor {FULLNAME}" in notes and f"ConfigMap {FULLNAME}-dashboard" in notes
    assert "grafana_dashboard=1" in notes
    assert "Prometheus Operator's CRDs (monitoring.coreos.com/v1) are not" in render(chart).notes


# --- monitoring and scaling -------------------------------------------------------------------------------------


def _check_service_monitor(monitor: dict[str, Any], release: Release) -> None:
    """What the Prometheus Operator needs of a ServiceMonitor, and that it scrapes our /metrics once per pod."""
    assert monitor["apiVersion"] == PROMETHEUS_OPERATOR and monitor["kind"] == "ServiceMonitor"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "podTargetLabels",
                         "targetLabels", "sampleLimit", "attachMetadata"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selector = spec["selector"]["matchLabels"]
    services = [s for s in release.all("Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in services] == [FULLNAME], "must select the API Service only"
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    assert spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT_FIELDS, set(endpoint) - SERVICE_MONITOR_ENDPOINT_FIELDS
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
        for key in ("interval", "scrapeTimeout"):
            assert PROMETHEUS_DURATION.match(endpoint[key]), endpoint[key]
        assert "authorization" not in endpoint  # /metrics needs no key


def test_service_monitor_scrapes_metrics_of_the_api_service(chart: helm.Chart) -> None:
    values = merged(example("ascend"), {"serviceMonitor": {"interval": "15s", "scrapeTimeout": "10s"}})
    release = render(chart, values, prometheus_operator=True)  # StatefulSet: a headless Service too
    monitor = release.one("ServiceMonitor", FULLNAME)
    _check_service_monitor(monitor, release)
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"


def test_service_monitor_appears_only_with_the_prometheus_operator_crd(chart: helm.Chart) -> None:
    assert not render(chart).all("ServiceMonitor")
    assert len(render(chart, prometheus_operator=True).all("ServiceMonitor")) == 1
    assert not render(chart, {"serviceMonitor": {"enabled": False}}, prometheus_operator=True).all("ServiceMonitor")


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet"])
def test_horizontal_pod_autoscaler_appears_only_when_enabled(chart: helm.Chart, kind: str) -> None:
    fixed = render(chart, {"workload": {"kind": kind}, "replicaCount": 3})
    assert not fixed.all("HorizontalPodAutoscaler") and fixed.workload["spec"]["replicas"] == 3
    scaled = render(chart, {"workload": {"kind": kind}, "autoscaling": {"enabled": True, "maxReplicas": 6}})
    hpa = scaled.one("HorizontalPodAutoscaler", FULLNAME)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": kind, "name": FULLNAME}
    assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 6
    assert "replicas" not in scaled.workload["spec"], "the HPA owns the replica count"


def _dashboard_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard", ROOT / "deploy" / "grafana" / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grafana_dashboard_configmap_holds_the_generated_dashboard(chart: helm.Chart) -> None:
    """The chart's dashboard is exactly what deploy/grafana/dashboard.py generates (run it to refresh the copy)."""
    dashboard = _dashboard_module()
    generated: str = dashboard.dashboard_json()
    assert dashboard.HELM_COPY == CHART_DIR / "dashboards" / "samrollout.json"
    stale = "stale: run `python deploy/grafana/dashboard.py`"
    assert (CHART_DIR / "dashboards" / "samrollout.json").read_text() == generated, stale
    assert dashboard.OUTPUT.read_text() == generated, stale
    config_map = render(chart).one("ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["data"]["samrollout.json"] == generated
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    relabelled = render(chart, {"grafanaDashboard": {"labels": {"grafana_dashboard": None, "dashboards": "ml"},
                                                     "namespace": "monitoring"}})
    config_map = relabelled.one("ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["dashboards"] == "ml" and "grafana_dashboard" not in \
        config_map["metadata"]["labels"]
    assert not render(chart, {"grafanaDashboard": {"enabled": False}}).all("ConfigMap")


# --- bad values -------------------------------------------------------------------------------------------------

BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "k is not a number": ({"server": {"k": "3"}}, "/server/k"),
    "k is 0": ({"server": {"k": 0}}, "/server/k"),
    "k is over 16": ({"server": {"k": 17}}, "/server/k"),
    "negative port": ({"server": {"port": -1}}, "/server/port"),
    "port over 65535": ({"server": {"port": 70000}}, "/server/port"),
    "service port 0": ({"service": {"port": 0}}, "/service/port"),
    "unknown backend": ({"backend": "rocm"}, "/backend"),
    "unknown threshold mode": ({"server": {"thresholdMode": "sometimes"}}, "/server/thresholdMode"),
    "unknown log level": ({"server": {"logLevel": "verbose"}}, "/server/logLevel"),
    "memory fraction 0": ({"server": {"gpuMemoryUtilization": 0}}, "/server/gpuMemoryUtilization"),
    "memory fraction over 1": ({"server": {"gpuMemoryUtilization": 1.5}}, "/server/gpuMemoryUtilization"),
    "max n over 1024": ({"server": {"maxN": 2048}}, "/server/maxN"),
    "context under 16": ({"server": {"maxModelLen": 8}}, "/server/maxModelLen"),
    "tensor parallel 0": ({"server": {"tensorParallelSize": 0}}, "/server/tensorParallelSize"),
    "vllm args as a string": ({"server": {"vllmArgs": "--enable-sleep-mode"}}, "/server/vllmArgs"),
    "misspelt server setting": ({"server": {"maxModelLength": 4096}}, "maxModelLength"),
    "unknown top-level key": ({"replicas": 2}, "replicas"),
    "unknown workload kind": ({"workload": {"kind": "DaemonSet"}}, "/workload/kind"),
    "negative replicas": ({"replicaCount": -1}, "/replicaCount"),
    "unknown volume type": ({"modelVolume": {"type": "nfs"}}, "/modelVolume/type"),
    "bad shm size": ({"shm": {"sizeLimit": "lots"}}, "/shm/sizeLimit"),
    "relative weight staging dir": ({"server": {"weightStagingDir": "staging"}}, "/server/weightStagingDir"),
    "bad weight staging size": ({"weightStaging": {"sizeLimit": "big"}}, "/weightStaging/sizeLimit"),
    "bad scrape interval": ({"serviceMonitor": {"interval": "5 seconds"}}, "/serviceMonitor/interval"),
    "numeric label": ({"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}, "/grafanaDashboard/labels"),
    "host mount without a mount path": (
        {"backends": {"ascend": {"hostMounts": [{"name": "driver", "hostPath": "/usr/local/Ascend"}]}}},
        "/backends/ascend/hostMounts/0"),
    "visible devices on cpu": ({"backends": {"cpu": {"visibleDevices": "0"}}}, "visibleDevices"),
    "bad visible devices": ({"backends": {"ascend": {"visibleDevices": "npu0"}}}, "/backends/ascend/visibleDevices"),
    "budget with no bound": ({"podDisruptionBudget": {"maxUnavailable": None}}, "/podDisruptionBudget"),
    "anti-affinity typo": ({"podAntiAffinity": "required"}, "/podAntiAffinity"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_fail_at_install_naming_the_value(chart: helm.Chart, case: str) -> None:
    values, where = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError) as checked:
        chart.validate_schema(values)
    assert where in str(checked.value)
    with pytest.raises(helm.HelmValuesError) as rendered:
        render(chart, values)
    assert where in str(rendered.value)


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=["defaults", *EXAMPLES])
def test_shipped_values_pass_the_schema(chart: helm.Chart, values: str | None) -> None:
    chart.validate_schema(example(values) if values else {})
