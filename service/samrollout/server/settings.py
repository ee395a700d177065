"""One typed settings model for the server, from which everything else is derived.

Each field of `ServerSettings` is one setting with one name and one range: its ``--flag`` (type,
choices and help come from the field's annotation and description), its ``SAMROLLOUT_*``
environment variable, its Helm value (``server.<camelCase>``, checked against the field by
tests/test_helm_chart.py), its line in the docs (rendered from the field by
docs/hooks/settings_reference.py) and, for speculation settings, the `SpeculationConfig` field it
sets (``json_schema_extra={"speculation": name}``).  Precedence is flag > environment variable >
default.  Every value is checked when the object is made (pydantic), so a bad setting stops
`samrollout serve` at start-up with a message naming it, before any model is loaded.  Turning the
settings into vLLM's flags is `samrollout.server.engine.vllm_argv`'s job.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import types
from pathlib import Path
from typing import Any, Literal, Self, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.config import JsonDict
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from samrollout.config import (
    CUDA_CRITICAL_PATH_TEXT,
    CUDA_DRAFT_RANGE_TEXT,
    LONG_TAIL_DRAFTS,
    SPECULATION_LIMITS,
    DeviceKind,
    SpeculationConfig,
    ThresholdMode,
    default_critical_path,
    default_draft_range,
    parse_draft_range,
    resolve_cost_prior,
)
from samrollout.drafter import DraftPolicy

BUILTIN_MODEL_NAME = "smollm2-135m-instruct"
LogLevel = Literal["debug", "info", "warning", "error"]
SchedulingPolicy = Literal["fcfs", "length-aware"]
"""How sequences are admitted to the engine: in arrival order, or by predicted length (`engine.admission`)."""
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = get_args(SchedulingPolicy)
ENV_PREFIX = "SAMROLLOUT_"
# Settings that are not flags: extra vLLM flags come after `--` (a positional remainder).
NOT_FLAGS = frozenset({"vllm_args"})


def _metavar(name: str) -> JsonDict:
    """A setting's ``json_schema_extra`` naming its flag's value in --help."""
    return {"metavar": name}


def _speculation(name: str, description: str, metavar: str | None = None) -> Any:
    """The field of a setting that is the `SpeculationConfig` field ``name``: its default and its range come from
    there (`SPECULATION_LIMITS`), so the flag, the variable and the Python API accept the same values."""
    low, high = SPECULATION_LIMITS.get(name, (None, None))
    extra: JsonDict = {"speculation": name} if metavar is None else {"speculation": name, "metavar": metavar}
    return Field(getattr(SpeculationConfig, name), ge=low, le=high, json_schema_extra=extra, description=description)


class ServerSettings(BaseSettings):
    """What `samrollout serve` runs: the model, where it listens, speculation, engine limits."""

    # An empty SAMROLLOUT_* variable means unset (compose files and charts pass optional values that way).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", env_ignore_empty=True)

    model: str | None = Field(None, json_schema_extra=_metavar("PATH"),
        description="HF model directory or id; unset: the built-in SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(None, json_schema_extra=_metavar("NAME"),
        description="name clients pass as `model` (default: the model path)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    api_key: SecretStr | None = Field(None, min_length=1,
                                      json_schema_extra=_metavar("KEY"),
        description="when set, /v1 and /admin require `Authorization: Bearer`; on the command line it shows in "
        "`ps`: prefer --api-key-file or the environment variable")
    api_key_file: str | None = Field(
        None, min_length=1, json_schema_extra=_metavar("PATH"),
        description="file holding the API key (its text, surrounding whitespace dropped): the key without showing "
        "it in `ps`; sets what --api-key sets, so give only one of the two")
    allow_unauthenticated_admin: bool = Field(
        False, description="serve /v1 and /admin without a key on a non-loopback --host (otherwise refused)")
    speculation: bool = Field(True, description="SAM speculative decoding on or off")
    threshold_mode: ThresholdMode = _speculation(
        "threshold_mode", description="adaptive: each row's draft source and length from expected goodput "
        "(accepted tokens per second of step time, both learned online; it drafts nothing where nothing pays) | "
        "static: --k drafts while at most --threshold requests run (and the static knobs) | off: --k drafts always")
    max_draft: int = _speculation("max_draft", metavar="TOKENS",
                                  description="adaptive: the longest draft a request may get in one step")
    cost_prior: str = Field(
        "auto", json_schema_extra=_metavar("auto|linear|PATH"),
        description="adaptive: the step-cost curve the engine's step times then correct: a cost table's path "
        "(bench/verify_cost.py), \"linear\" (a compute-bound step), or \"auto\": the table shipped for the "
        "device (CUDA: an H100's), else linear")
    k: int = _speculation("k", description="static and off: draft tokens per step")
    threshold: int = _speculation("threshold", description="static: running requests at or below which drafting runs")
    draft_range: str = Field(
        "auto", json_schema_extra=_metavar("auto|none|R:K,..."),
        description='static: draft length by running requests, "R:K,..." (k drafts while at most R run, none '
        'above the last R), e.g. "2:16,8:8"; "none": --k up to --threshold; "auto": the backend\'s projected '
        f"default (CUDA: {CUDA_DRAFT_RANGE_TEXT} with K = --k, {LONG_TAIL_DRAFTS} raised to --k if larger; CPU and "
        "NPU: none, --k up to --threshold)")
    group_drafting: bool = _speculation(
        "group_drafting", description="siblings of one group draft from a shared automaton")
    draft_history_tokens: int = _speculation(
        "history_tokens", metavar="TOKENS",
        description="response tokens of earlier rollouts kept as drafting text for later rollouts of the same "
        "prompt (LRU; 0: off); with it on, requests without a group id are grouped by prompt")
    confident_match: int = _speculation(
        "confident_match", metavar="TOKENS",
        description="static: past the threshold, rows whose draft comes from a match of at least this many tokens "
        "still draft, at most --k tokens (0: off)")
    critical_path: str = Field(
        "auto", json_schema_extra=_metavar("auto|none|ROWS:K"),
        description='critical path, "ROWS:K": the ROWS running requests that have run longest (and longer '
        "than the rest) weigh K times in the adaptive goodput (for synchronous trainers: a step ends with its "
        "longest response), or in the static mode draft up to K tokens at every batch size; \"none\": off; "
        f"\"auto\": adaptive none; static: the backend's projected default (CUDA: {CUDA_CRITICAL_PATH_TEXT}; CPU "
        "and NPU: none)")
    draft_history_responses: int = _speculation(
        "history_responses", metavar="N",
        description="earlier responses kept per prompt (the newest)")
    draft_policy: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra=_metavar("JSON"),
        description='DraftPolicy fields as a JSON object, e.g. {"min_match_length": 2}; '
        "fields left out keep their defaults")
    max_model_len: int | None = Field(None, ge=16, description="context length (default: the model's)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="accelerator memory fraction (default 0.9; 0.3 on CPU)")
    tensor_parallel_size: int = Field(1, ge=1, description="passed to vLLM")
    max_num_seqs: int | None = Field(None, ge=1, description="requests the engine runs at once (vLLM's default)")
    max_n: int = Field(64, ge=1, le=1024, description="largest `n` a request may ask for")
    max_prompts: int = Field(256, ge=1, description="most prompts one completion request may batch")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="longest prompt, in tokens, a request may send (default: the context length)")
    dtype: str = Field("auto", description="model dtype passed to vLLM (auto on a CPU without native bfloat16: "
                       "float32, several times faster there)")
    seed: int = Field(0, description="engine seed")
    weight_version: str = Field("initial", min_length=1, description="version tag of the weights loaded at start")
    chunked_prefill: bool = Field(
        True, description="split long prompts across engine steps, so one long prompt cannot stall the others")
    compile: bool | None = Field(
        None, description="torch compile (vLLM's default) instead of eager mode (default: on, but off on CPU, "
        "where the first start compiled for minutes and gained nothing measurable)")
    per_request_metrics: bool = Field(
        True, description="per-request timing and acceptance in responses (n = 1; vLLM 0.32 and 0.33, not 0.23)")
    rollout_scheduling: SchedulingPolicy = Field(
        "length-aware", description="length-aware (default): each group's first sequence first, then the groups "
        "predicted longest (docs: Scheduling); fcfs: requests enter the engine as they arrive (vLLM's order)")
    scheduling_history: int = Field(
        4096, ge=0, le=1_000_000, description="prompts whose response lengths length-aware scheduling remembers "
        "from earlier rollouts (LRU; 0: none)")
    rollout_idle_seconds: float = Field(2.0, gt=0.0, description="a rollout ends this long after its last response")
    shutdown_timeout: float = Field(30.0, ge=0.0, description="seconds SIGTERM waits for in-flight requests")
    weight_staging_dir: str | None = Field(
        None, min_length=1, json_schema_extra=_metavar("DIR"),
        description="directory where weights pushed over HTTP (/admin/weight_uploads) are "
        "staged until they are committed (default: samrollout-weight-uploads under the system temp dir)")
    max_weight_upload_bytes: int | None = Field(
        None, ge=1, description="most bytes one weight upload may stage, all its files together (default: twice "
        "the served checkpoint's tensor bytes plus 64 MiB; 64 GiB when the model is not a local safetensors "
        "directory)")
    max_weight_uploads: int = Field(2, ge=1, le=64, description="weight uploads open at once")
    weight_upload_idle_seconds: float = Field(
        600.0, gt=0.0, description="a weight upload untouched this long is cancelled and its files deleted")
    allow_plain_http_peers: bool = Field(
        False, description="with an API key, relay to --weight-peers over plain http:// beyond loopback (otherwise "
        "refused: every request to a peer carries the key in clear); only on a network that encrypts or that "
        "nobody else can read")
    weight_peers: str = Field(
        "", json_schema_extra=_metavar("URLS"),
        description="the servers this one may pass pushed weight files on to (comma-separated base URLs, e.g. "
        "https://rollout-1:8443; with a key, plain http:// beyond loopback needs --allow-plain-http-peers; a name "
        "that resolves to several addresses, such as a headless service, stands "
        "for each): a push then crosses the trainer's link once, not once per server. Only these are ever "
        "contacted; none: pushes go directly to each server")
    areal_routes: bool = Field(
        False, description="also serve AReaL's inference-server routes (/areal_pause_generation, "
        "/areal_update_weights, ...), so that AReaL's vLLM engine drives this server; needs --weights-root (or "
        "--allow-any-weights-path); with --api-key, AReaL (which sends no key) connects to --areal-port; the weights "
        "start as version 0 unless --weight-version says otherwise")
    areal_port: int | None = Field(
        None, ge=1, le=65535, description="with --areal-routes: a second port, on --host, for the trainer only: "
        "there AReaL's routes and /v1/completions answer without the API key (AReaL sends none), everything else "
        "as on --port; admit only the trainer to it (Helm: a NetworkPolicy)")
    weights_root: str | None = Field(
        None, min_length=1, json_schema_extra=_metavar("DIR"),
        description="weights loaded by path (/admin/update_weights, /areal_update_weights) must lie inside this "
        "directory, symbolic links and '..' resolved (else 403); unset: any directory the server can read")
    allow_any_weights_path: bool = Field(
        False, description="serve --areal-routes without --weights-root: AReaL's update route may then load "
        "weights from any directory the server can read (only where nobody else reaches the trainer's port)")
    weight_value_check: bool = Field(
        True, description="refuse weight updates holding NaN or infinite values (reads every tensor once; off: "
        "for trainers that check their weights themselves)")
    weight_check_timeout: float = Field(
        600.0, gt=0.0, json_schema_extra=_metavar("SECONDS"),
        description="seconds a weight update's file checks may take before it is refused (the "
        "value check reads every byte: about 1 GB/s per core)")
    max_request_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, json_schema_extra=_metavar("BYTES"),
        description="largest request body (413 beyond, before it is read); weight "
        "files pushed to /admin/weight_uploads have their own limit")
    max_connections: int = Field(
        1024, ge=1, description="open HTTP connections on --port (beyond: 503 and closed); the trainer's port "
        "--areal-port has its own budget (--trainer-max-connections)")
    trainer_max_connections: int = Field(
        256, ge=1, description="open HTTP connections on the trainer's port --areal-port, never taken by --port's "
        "(beyond: 503 and closed)")
    areal_max_held_requests: int = Field(
        4096, ge=0, description="with --areal-routes: generation requests AReaL's pause may hold at once (beyond: "
        "429 with Retry-After)")
    areal_hold_timeout: float = Field(
        1200.0, gt=0.0, json_schema_extra=_metavar("SECONDS"),
        description="with --areal-routes: seconds a request held by AReaL's pause waits for continue (then 503)")
    allowed_hosts: str = Field(
        "", json_schema_extra=_metavar("HOSTS"),
        description="Host header names accepted besides IP literals, localhost names and --host (comma-separated; "
        "'.example.com' also admits its subdomains, '*' admits any): others get 403, which stops DNS rebinding")
    allowed_origins: str = Field(
        "", json_schema_extra=_metavar("ORIGINS"),
        description="browser origins (scheme://host[:port], comma-separated, '*' for any) whose requests are "
        "served besides same-origin ones; a request with any other Origin header gets 403")
    header_timeout: float = Field(
        15.0, gt=0.0, json_schema_extra=_metavar("SECONDS"),
        description="seconds a connection may take to send a request's headers (also an idle "
        "new connection), then it is closed")
    body_timeout: float = Field(
        60.0, gt=0.0, json_schema_extra=_metavar("SECONDS"),
        description="seconds a request's body may take to arrive once its headers are in (then 408 and "
        "closed); weight files pushed to /admin/weight_uploads are exempt")
    keep_alive_timeout: int = Field(5, ge=1, json_schema_extra=_metavar("SECONDS"),
        description="seconds an idle keep-alive connection stays open")
    max_queued_requests: int = Field(
        16384, ge=0, description="sequences (prompts x n) that may wait beyond those the engine runs; beyond: 429 "
        "with Retry-After")
    log_level: LogLevel = Field("info", description="server log level")
    vllm_args: list[str] = Field(default_factory=list, description="extra vLLM engine flags, passed through")

    @field_validator("api_key")
    @classmethod
    def _usable_api_key(cls, value: SecretStr | None) -> SecretStr | None:
        """A key clients can send: visible ASCII, no surrounding whitespace (a blank key matches no client)."""
        if value is None:
            return value
        key = value.get_secret_value()
        if not key.strip():
            raise ValueError("the API key is blank: no client can send it; set a real key (openssl rand -hex 24)")
        if key != key.strip():
            raise ValueError("the API key starts or ends with whitespace, which HTTP clients drop from headers")
        if not all(33 <= ord(c) <= 126 for c in key):
            raise ValueError("the API key must be printable ASCII without spaces (what an HTTP header carries)")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("draft_range")
    @classmethod
    def _valid_draft_range(cls, value: str) -> str:
        if value not in ("auto", "none"):
            parse_draft_range(value)  # raises ValueError saying how to write it
        return value

    @field_validator("critical_path")
    @classmethod
    def _valid_critical_path(cls, value: str) -> str:
        default_critical_path(value, "cpu")  # raises ValueError saying how to write it
        return value

    @field_validator("cost_prior")
    @classmethod
    def _valid_cost_prior(cls, value: str) -> str:
        if value not in ("auto", "linear") and not Path(value).is_file():
            raise ValueError(f"cost prior {value!r}: give auto, linear or the path of a cost table JSON "
                             "(bench/verify_cost.py writes them)")
        return value

    @field_validator("weight_peers")
    @classmethod
    def _valid_weight_peers(cls, value: str) -> str:
        parse_peer_urls(value)  # raises ValueError naming the bad URL
        return value

    @field_validator("draft_policy")
    @classmethod
    def _valid_draft_policy(cls, value: dict[str, Any]) -> dict[str, Any]:
        DraftPolicy.from_dict(value)  # raises ValueError naming the bad field
        return value

    @model_validator(mode="after")
    def _key_from_its_file(self) -> Self:
        """``--api-key-file``: the key read from the file (what ``--api-key`` would set), given only once."""
        if self.api_key_file is None:
            return self
        if self.api_key is not None:
            raise ValueError("both --api-key and --api-key-file are set (or SAMROLLOUT_API_KEY and "
                             "SAMROLLOUT_API_KEY_FILE): give the key once, preferably as the file")
        self.api_key = type(self)._usable_api_key(SecretStr(read_key_file(self.api_key_file)))
        return self

    @model_validator(mode="after")
    def _key_not_sent_in_clear(self) -> Self:
        """With a key, peers reached over plain http beyond loopback would carry it in clear: refused unless told."""
        plain = plain_http_peers(self.weight_peers) if self.api_key is not None else []
        if plain and not self.allow_plain_http_peers:
            raise ValueError(
                f"--weight-peers {', '.join(plain)}: plain http:// beyond loopback, and every request to a peer "
                "carries the API key in clear (probes every 15 s, relayed files): give the peers as https:// URLs, "
                "or pass --allow-plain-http-peers (SAMROLLOUT_ALLOW_PLAIN_HTTP_PEERS=true) on a network that "
                "encrypts (a service mesh with mTLS) or that nobody else can read")
        return self

    @model_validator(mode="after")
    def _no_open_admin_beyond_loopback(self) -> Self:
        """Refuse to serve /admin (weight updates, aborts) without a key to other machines, unless told to."""
        if self.api_key is None and not self.allow_unauthenticated_admin and not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} is reachable from other machines and no --api-key is set: anyone who reaches "
                "the server could load weights and abort rollouts (/admin) and generate (/v1). Set --api-key "
                "(SAMROLLOUT_API_KEY), listen on a loopback address (127.0.0.1, ::1, localhost), or pass "
                "--allow-unauthenticated-admin (SAMROLLOUT_ALLOW_UNAUTHENTICATED_ADMIN=true) on a network you trust")
        return self

    @model_validator(mode="after")
    def _areal_routes_for_the_trainer_only(self) -> Self:
        """AReaL's routes load weights for whoever calls them: confined to a weights root (or told not to be), and,
        with a key, answered without it only on the trainer's own port; they start at AReaL's version 0."""
        if self.areal_port is not None and not self.areal_routes:
            raise ValueError("--areal-port serves AReaL's routes: it needs --areal-routes")
        if not self.areal_routes:
            return self
        if self.weights_root is None and not self.allow_any_weights_path:
            raise ValueError(
                "--areal-routes lets AReaL's trainer load weights by path without a key: set --weights-root DIR "
                "(SAMROLLOUT_WEIGHTS_ROOT; the directory its checkpoints are saved under), or pass "
                "--allow-any-weights-path where nobody but the trainer reaches the server (docs/security.md)")
        if self.api_key is not None and self.areal_port is None:
            raise ValueError(
                "--areal-routes with --api-key needs --areal-port: AReaL's engine sends no Authorization header, so "
                "it connects to a port of its own where AReaL's routes and /v1/completions need no key (admit only "
                "the trainer to it); /admin, the weight uploads and /docs keep the key (docs/security.md)")
        if self.areal_port is not None and self.areal_port == self.port:
            raise ValueError(f"--areal-port {self.areal_port} is --port: give the trainer a port of its own")
        if "weight_version" not in self.model_fields_set:
            self.weight_version = "0"  # AReaL's first version; its updates are 1, 2, ... (areal_routes)
        return self

    def speculation_config(self, device: DeviceKind) -> SpeculationConfig | None:
        """The shared speculation config (None when speculation is off); raises ValueError if invalid.

        ``device``: what the engine runs on; ``--draft-range auto`` and ``--critical-path auto`` mean its defaults.
        """
        if not self.speculation:
            return None
        values = {target: getattr(self, name) for name, target in speculation_fields().items()}
        policy = DraftPolicy.from_dict(self.draft_policy)
        if self.threshold_mode == "adaptive":
            rows, weight = (0, 1) if self.critical_path == "auto" else default_critical_path(self.critical_path, device)
            return SpeculationConfig(**values, policy=policy, critical_rows=rows, critical_weight=float(weight),
                                     cost_prior=resolve_cost_prior(self.cost_prior, device))
        critical_rows, critical_k = default_critical_path(self.critical_path, device)
        return SpeculationConfig(
            **values, policy=policy, critical_rows=critical_rows, critical_k=critical_k,
            draft_range=default_draft_range(self.draft_range, self.k, self.threshold, device))

    def public_model_name(self, model_path: str) -> str:
        """The model name clients send and `/v1/models` lists."""
        if self.served_model_name:
            return self.served_model_name
        return BUILTIN_MODEL_NAME if self.model is None else self.model


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine: 127.0.0.0/8, ::1 or localhost."""
    name = host.strip().strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False  # another host name: it may resolve to anything
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def json_object(text: str, flag: str) -> dict[str, Any]:
    """A flag's JSON object value; anything else is an argparse error naming the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {text!r}")
    return value


def speculation_fields() -> dict[str, str]:
    """Server setting -> the `SpeculationConfig` field it sets as is (the settings marked ``speculation``)."""
    return {name: str(extra["speculation"]) for name, field in ServerSettings.model_fields.items()
            if isinstance(extra := field.json_schema_extra, dict) and "speculation" in extra}


def env_var(name: str) -> str:
    """The environment variable of a setting: ``SAMROLLOUT_MAX_MODEL_LEN`` for ``max_model_len``."""
    return f"{ENV_PREFIX}{name.upper()}"


def flag(name: str) -> str:
    """The command-line flag of a setting: ``--max-model-len`` for ``max_model_len``."""
    return f"--{name.replace('_', '-')}"


def flag_options(name: str, field: FieldInfo) -> dict[str, Any]:
    """argparse keywords for a setting's flag, from the field's type: booleans are ``--x/--no-x``, Literal types
    give the choices, numbers their type, JSON objects are parsed; a ``metavar`` in the field's extra names the
    value."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    options: dict[str, Any] = {}
    if annotation is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif get_origin(annotation) is Literal:
        options["choices"] = list(get_args(annotation))
    elif annotation in (int, float):
        options["type"] = annotation
    elif get_origin(annotation) is dict:
        options["type"] = lambda text: json_object(text, flag(name))
    if isinstance(extra := field.json_schema_extra, dict) and "metavar" in extra:
        options["metavar"] = extra["metavar"]
    return options


def default_text(name: str, field: FieldInfo) -> str:
    """A setting's default as help and docs show it."""
    return "built-in model" if name == "model" else str(field.get_default(call_default_factory=True))


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (``--max-model-len`` for ``max_model_len``); unset flags keep env/defaults."""
    for name, field in ServerSettings.model_fields.items():
        if name in NOT_FLAGS:
            continue
        help_text = f"{field.description} [env {env_var(name)}; default {default_text(name, field)}]"
        parser.add_argument(flag(name), dest=name, default=argparse.SUPPRESS, help=help_text,
                            **flag_options(name, field))
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, default=[],
                        help="after `--`: extra vLLM engine flags, e.g. -- --max-num-batched-tokens 4096")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Settings from parsed flags over the environment."""
    given = {name: getattr(args, name) for name in ServerSettings.model_fields
             if name not in NOT_FLAGS and hasattr(args, name)}
    extra = [a for a in getattr(args, "vllm_args", []) if a != "--"]
    if extra:
        given["vllm_args"] = extra
    return ServerSettings(**given)


def read_key_file(path: str) -> str:
    """The API key held by the file ``path`` (surrounding whitespace, such as its final newline, dropped)."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file {path}: cannot read the key: {error}") from None
    if not key:
        raise ValueError(f"--api-key-file {path} is empty: write the key into it (openssl rand -hex 24 > {path})")
    return key


def plain_http_peers(text: str) -> list[str]:
    """The ``--weight-peers`` reached over plain ``http://`` at an address that is not loopback."""
    return [url for url in parse_peer_urls(text)
            if urlsplit(url).scheme == "http" and not is_loopback(urlsplit(url).hostname or "")]


def parse_peer_urls(text: str) -> list[str]:
    """``--weight-peers``: comma-separated ``http(s)://host:port`` base URLs; ValueError naming a bad one."""
    urls = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        parts = urlsplit(entry)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") \
                or parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"weight peer {entry!r}: give a base URL such as http://server-1:8000 (no path, query "
                             "or credentials)")
        try:
            parts.port  # noqa: B018  (a bad port raises here)
        except ValueError:
            raise ValueError(f"weight peer {entry!r}: bad port") from None
        urls.append(entry.rstrip("/"))
    return urls
