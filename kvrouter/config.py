"""Settings and the replicas.yaml model.

Two sources of configuration, kept apart on purpose:

* `Settings` (pydantic-settings, env prefix ``KVROUTER_``; CLI flags override env): how this router process
  behaves — where it listens, which policy, timeouts, limits, the Redis URL.
* `FleetConfig` (replicas.yaml): what the fleet is — the replicas, their KV-event endpoints, the model's
  tokenizer and the engine block size. Operators reload it live; settings need a restart.

A replicas.yaml may instead hold a `models:` list of fleets (`ModelsConfig`, read by `load_router_config`): one
router serves them all, dispatching each request by its `model` (kvrouter/server/fleets.py).

`load_fleet(path)` reads a one-fleet replicas.yaml (`load_router_config` either shape); both raise `ConfigError`
with one message naming the file, the field and what was expected, which the CLI prints before exiting with code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvrouter.flow.settings import FlowConfig
from kvrouter.typedefs import DisaggMode, ReplicaName, ReplicaRole, SessionMode

PolicyName = Literal["round_robin", "least_loaded", "kv_aware"]
SessionKeySource = Literal["header", "user", "both", "off"]
POLICY_NAMES: tuple[str, ...] = ("round_robin", "least_loaded", "kv_aware")


class ConfigError(Exception):
    """A configuration file or value is wrong; the message is meant for the operator as is."""


class KvEventsConfig(BaseModel):
    """Where a replica's vLLM KV-cache event publisher is (vLLM's ``--kv-events-config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = Field(
        description="ZMQ address of the engine's PUB socket as the router reaches it, e.g. tcp://10.0.0.5:5557.",
    )
    replay_endpoint: str | None = Field(
        default=None,
        description="ZMQ address of the engine's replay (ROUTER) socket; lost events are re-asked here.",
    )
    topic: str = Field(default="kv-events", description="Topic the engine publishes under ('' for none).")
    bind: bool = Field(
        default=False,
        description=(
            "Bind instead of connect. vLLM binds its PUB socket only when its endpoint has '*' or '::' "
            "(or is ipc/inproc) and connects otherwise; when vLLM connects, the router must bind here."
        ),
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description=(
            "The engine's --data-parallel-size. vLLM publishes (and replays) DP rank r on the tcp ports of "
            "endpoint and replay_endpoint plus r; the router follows every rank."
        ),
    )
    # Issue 15, hostile KV events: a size cap and a peer allow-list for bind mode.
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        le=1024 * 1024 * 1024,
        description=(
            "Largest event message (one ZMQ frame) accepted from this publisher (ZMQ's MAXMSGSIZE on the event "
            "and replay sockets): a bigger one drops the peer's connection and is never buffered, so it shows as "
            "a seq gap (replayed if it fits, else counted lost and the rank cleared). A real vLLM step is ~70 bytes "
            "per 16-token block (a 64k-token step ~300 KB); the default bounds one message's ingest stall to ~50 ms."
        ),
    )
    allow_from: list[str] | None = Field(
        default=None,
        description=(
            "bind only: IP addresses or CIDR networks allowed to connect and publish (enforced with ZMQ's ZAP "
            "handshake). vLLM's publisher cannot authenticate (no CURVE or PLAIN keys), so without it bind mode "
            "trusts every process that can reach the address; use it, a network policy, or an ipc:// endpoint "
            "with file permissions."
        ),
    )

    @field_validator("allow_from")
    @classmethod
    def _networks(cls, value: list[str] | None) -> list[str] | None:
        import ipaddress  # here, so this part's addition stays one block

        if value is not None:
            for network in value:
                ipaddress.ip_network(network, strict=False)  # ValueError names the bad entry
        return value

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("expected a ZMQ address starting with tcp://, ipc:// or inproc://")
        return value


class ReplicaConfig(BaseModel):
    """One vLLM replica (one OpenAI-compatible server, possibly data-parallel inside)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")] = Field(
        description="Unique name; used in metrics labels, logs and the x-kvrouter-replica header.",
    )
    url: AnyHttpUrl = Field(
        description=(
            "Base URL of the replica's OpenAI server, e.g. http://10.0.0.5:8000, without /v1 (kvrouter appends "
            "the OpenAI paths), a query or a fragment."
        )
    )
    kv_events: KvEventsConfig | None = Field(
        default=None, description="The replica's KV event publisher; without it the replica is routed on load only."
    )
    block_size: int | None = Field(
        default=None, ge=1, le=4096, description="Engine block size if it differs from the fleet's block_size."
    )
    weight: float = Field(default=1.0, gt=0, description="Relative capacity; a 2.0 replica takes twice the load.")
    role: ReplicaRole = Field(
        default="both",
        description=(
            "Disaggregated prefill/decode (docs/disaggregation.md): 'prefill' takes prefill legs only (vLLM with a "
            "KV connector as producer or kv_both), 'decode' takes decode legs and, under conditional "
            "disaggregation, short requests whole; 'both' (default) serves whole requests."
        ),
    )
    lora_adapters: list[str] = Field(
        default_factory=list,
        description=(
            "LoRA adapters this replica serves besides the fleet's own `lora_adapters` (served by every replica): "
            "a request naming one goes only to replicas that serve it (docs/multi-model.md)."
        ),
    )

    @field_validator("url")
    @classmethod
    def _base_url_only(cls, url: AnyHttpUrl) -> AnyHttpUrl:
        # The router appends /v1/chat/completions and the other paths itself: a URL that already carries /v1
        # is accepted by every HTTP check and then answers 404 to every request, so it is refused here.
        base = str(url).split("?", 1)[0].split("#", 1)[0].rstrip("/")
        if "v1" in (url.path or "").split("/"):
            raise ValueError(
                f"{str(url)!r} has '/v1' in its path; drop it (e.g. {base.rsplit('/v1', 1)[0]}): kvrouter appends "
                "/v1/chat/completions and the other OpenAI paths itself"
            )
        if url.query is not None or url.fragment is not None:
            raise ValueError(f"{str(url)!r} has a query or fragment; give the server's base URL only (e.g. {base})")
        return url

    @property
    def replica(self) -> ReplicaName:
        return ReplicaName(self.name)

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


class DisaggregationConfig(BaseModel):
    """When a fleet that has prefill workers splits requests into a prefill leg and a decode leg."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: DisaggMode = Field(
        default="conditional",
        description=(
            "'conditional': a request whose uncached prefill on the best decode-capable replica is at most "
            "max_local_prefill_tokens runs there whole, longer ones are split; 'always': every request is split "
            "while a prefill worker is routable; 'off': never split (prefill workers serve whole requests). Only "
            "fleets with at least one role: prefill replica are affected."
        ),
    )
    max_local_prefill_tokens: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Conditional mode: the most uncached prompt tokens a decode worker computes itself. Default: the "
            "engine's pass budget (the router's kv_batch_tokens), so a local prefill holds its decode batch back "
            "for at most one pass."
        ),
    )
    prefill_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "The longest a prefill leg may take to answer; past it the leg is abandoned and the request runs whole "
            "on a decode-capable replica."
        ),
    )


class FleetConfig(BaseModel):
    """The whole replicas.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: list[ReplicaConfig] = Field(min_length=1, description="The replicas to route to.")
    model: str | None = Field(
        default=None,
        description=(
            "Served model name (what clients put in 'model'): informational with one fleet; in a `models:` list "
            "it is required and requests are dispatched by it."
        ),
    )
    aliases: list[str] = Field(
        default_factory=list,
        description=(
            "More served names of this fleet's model (a `models:` list dispatches them here); the request is "
            "forwarded unchanged, so the replicas must serve them too (vLLM's --served-model-name NAME ALIAS...)."
        ),
    )
    policy: PolicyName | None = Field(
        default=None, description="This fleet's routing policy instead of the router's `policy` setting."
    )
    tokenizer: str | None = Field(
        default=None,
        description=(
            "Local directory of the model's Hugging Face tokenizer (tokenizer.json, tokenizer_config.json, "
            "chat template). Never downloaded. Without it requests are routed on load only."
        ),
    )
    block_size: int = Field(default=16, ge=1, le=4096, description="The engines' KV block size (--block-size).")
    hash_seed: int = Field(default=0, ge=0, lt=2**64, description="Seed of kvrouter's own block keys.")
    lora_adapters: list[str] = Field(
        default_factory=list,
        description="Names of LoRA adapters served by the replicas; a request naming one gets isolated keys.",
    )
    flow: FlowConfig = Field(
        default_factory=FlowConfig,
        description="The router queue: saturation, priority bands, tenants and their weights (docs/flow-control.md).",
    )
    disaggregation: DisaggregationConfig = Field(
        default_factory=DisaggregationConfig,
        description="Prefill/decode disaggregation for fleets with role: prefill replicas (docs/disaggregation.md).",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> FleetConfig:
        seen: set[str] = set()
        for replica in self.replicas:
            if replica.name in seen:
                raise ValueError(f"replica name {replica.name!r} appears twice; names must be unique")
            seen.add(replica.name)
        roles = {replica.role for replica in self.replicas}
        if roles == {"prefill"}:
            raise ValueError("every replica has role 'prefill': a decode-capable one (role decode or both) is needed")
        return self

    def block_size_of(self, replica: ReplicaConfig) -> int:
        return replica.block_size or self.block_size

    def adapters_of(self, replica: ReplicaConfig) -> frozenset[str]:
        """The LoRA adapters `replica` serves: the fleet's and its own."""
        return frozenset(self.lora_adapters) | frozenset(replica.lora_adapters)

    @property
    def all_adapters(self) -> frozenset[str]:
        """Every LoRA adapter some replica of the fleet serves."""
        served = set(self.lora_adapters)
        for replica in self.replicas:
            served.update(replica.lora_adapters)
        return frozenset(served)

    @property
    def served_names(self) -> tuple[str, ...]:
        """What a request's `model` may name to reach this fleet: the model, its aliases, its adapters."""
        names = [] if self.model is None else [self.model]
        return (*names, *self.aliases, *sorted(self.all_adapters))


class ModelsConfig(BaseModel):
    """A replicas.yaml with a `models:` list: several fleets behind one router, dispatched by the request's
    `model` (docs/multi-model.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[FleetConfig] = Field(min_length=1, description="The fleets, one per served model.")

    @model_validator(mode="after")
    def _unique_across_fleets(self) -> ModelsConfig:
        replicas: set[str] = set()
        names: dict[str, int] = {}
        for position, fleet in enumerate(self.models):
            if fleet.model is None:
                raise ValueError(f"models[{position}] has no 'model': each fleet of a models list names its model")
            for replica in fleet.replicas:
                if replica.name in replicas:
                    raise ValueError(
                        f"replica name {replica.name!r} appears in two fleets; names must be unique across fleets "
                        "(they label metrics)"
                    )
                replicas.add(replica.name)
            for name in dict.fromkeys(fleet.served_names):
                if name in names:
                    raise ValueError(
                        f"model name {name!r} is served by models[{names[name]}] and models[{position}]; each model "
                        "name, alias and LoRA adapter must belong to one fleet"
                    )
                names[name] = position
        return self


def _format_validation_error(path: Path, error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"]) or "(top level)"
    problem = first["msg"]
    extra = len(error.errors()) - 1
    more = f" (and {extra} more problem{'s' if extra > 1 else ''})" if extra else ""
    return f"{path}: field '{location}': {problem}{more}"


def parse_fleet(data: object, source: Path) -> FleetConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with a 'replicas' list at the top level")
    if "models" in data:
        raise ConfigError(
            f"{source}: has a 'models' list (several fleets); this needs a router started with it "
            "(`kvrouter serve --replicas`), and a running router cannot switch to it live"
        )
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(source, error)) from None


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and validate replicas.yaml; relative tokenizer paths resolve against the file's directory."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{source}: cannot read the file: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from None
    return _resolve_tokenizer(parse_fleet(data, source), source)


def parse_models(data: object, source: Path) -> ModelsConfig:
    """A `models:` file; `ConfigError` names the fleet's position and field on error."""
    if not isinstance(data, dict) or "models" not in data:
        raise ConfigError(f"{source}: expected a mapping with a 'models' list at the top level")
    if "replicas" in data:
        raise ConfigError(f"{source}: has both 'replicas' (one fleet) and 'models' (several); keep one")
    try:
        return ModelsConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(source, error)) from None


def load_router_config(path: str | Path) -> FleetConfig | ModelsConfig:
    """Read replicas.yaml in either shape: one fleet (top-level `replicas:`, as `load_fleet`) or a `models:` list
    of fleets; relative tokenizer paths resolve against the file's directory."""
    source = Path(path)
    try:
        data = yaml.safe_load(source.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"{source}: cannot read the file: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from None
    if not (isinstance(data, dict) and "models" in data):
        return _resolve_tokenizer(parse_fleet(data, source), source)
    models = parse_models(data, source)
    fleets = [_resolve_tokenizer(fleet, source) for fleet in models.models]
    return models.model_copy(update={"models": fleets})


def _resolve_tokenizer(fleet: FleetConfig, source: Path) -> FleetConfig:
    if fleet.tokenizer is not None and not Path(fleet.tokenizer).is_absolute():
        return fleet.model_copy(update={"tokenizer": str((source.parent / fleet.tokenizer).resolve())})
    return fleet


# vLLM's OpenAI-server endpoints that clients use besides completions (vllm/entrypoints/openai/api_server.py and
# the pooling routers); its operator endpoints are left out on purpose.
DEFAULT_PASSTHROUGH_PATHS = (
    "/tokenize",
    "/detokenize",
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/responses",
    "/v1/responses/*",
    "/version",
)


class Settings(BaseSettings):
    """How this router process behaves. Every field is also ``KVROUTER_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="KVROUTER_", extra="ignore")

    replicas: Path | None = Field(default=None, description="Path of replicas.yaml.")
    host: str = Field(default="0.0.0.0", description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on.")
    policy: PolicyName = Field(default="kv_aware", description="Routing policy.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info")
    redis_url: str | None = Field(
        default=None, description="Follow KV events through Redis (relay mode) instead of ZMQ from each replica."
    )
    workers: int = Field(default=1, ge=1, le=256, description="Router processes sharing the port (SO_REUSEPORT).")
    load_share: bool = Field(
        default=True,
        description="With `redis_url`: share each instance's own load (in flight, pending prefill, decoding, routed "
        "prefixes) with the other router instances through Redis pub/sub (docs/scaling.md).",
    )
    load_share_interval_s: float = Field(
        default=0.02,
        gt=0,
        le=1.0,
        description="The load plane's tick: expire silent peers and publish a change no request signalled. Changes "
        "from routed requests are published at once, one report in flight at a time (docs/scaling.md).",
    )
    load_share_blind_group: bool = Field(
        default=True,
        description="With shared load: place the peers' decisions this instance cannot see yet (two share intervals) "
        "before deciding, so instances reading the same stale load do not herd onto one replica "
        "(kvrouter/routing/herding.py, docs/scaling.md).",
    )
    load_share_stagger_max_s: float = Field(
        default=0.05,
        ge=0,
        le=1.0,
        description="With the blind group: an instance of rank r (among the live instances, by name) waits r times "
        "the blind group's horizon (twice the measured staleness) before deciding, so a burst spread over the "
        "instances is decided in rank order, each seeing the earlier ones; the last rank waits at most this long "
        "(the steps shrink alike past it) (kvrouter/routing/herding.py, docs/scaling.md); 0: never wait.",
    )
    load_share_calibration: bool = Field(
        default=False,
        description="With shared load and kv_aware's calibration: each load report carries the TTFT observations "
        "this instance made since the last one, and every instance fits its peers' beside its own, so all price "
        "each replica from the fleet's whole history as one router would (kvrouter/routing/sharing.py). Off by "
        'default: on the held-out trace it bought no tail latency (docs/scaling.md, "Shared calibration").',
    )
    load_share_heartbeat_s: float = Field(
        default=0.5, gt=0, le=10.0, description="Publish a load report this often even when nothing changed."
    )
    load_share_expiry_s: float = Field(
        default=3.0, gt=0, le=60.0, description="A peer instance silent this long stops counting (its load expires)."
    )
    saturation_queue_s: float = Field(
        default=2.0,
        gt=0,
        description="Seconds of queued prefill (at the replica's calibrated prefill rate, else "
        "kv_prefill_tokens_per_s) at which a replica counts as saturated in kvrouter_fleet_saturation, the "
        "autoscaling signal.",
    )
    load_share_dir: Path | None = Field(
        default=None,
        description="Without redis_url: a private directory where router processes on one host share load over "
        "Unix datagram sockets (`--workers` makes one itself; set it to share with processes started otherwise).",
    )
    workers_dir: Path | None = Field(
        default=None,
        description="Set by the --workers supervisor: a private directory where each worker serves its own metrics "
        "on a Unix socket, so a scrape of the shared port holds every worker's (labelled `worker`).",
    )
    load_share_prefix_blocks: int = Field(
        default=256, ge=0, le=4096, description="Leading blocks of each routed prefix shared with peer instances."
    )

    connect_timeout_s: float = Field(default=5.0, gt=0, description="Timeout to connect to a replica.")
    read_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest wait for the next chunk from a replica (first token included)."
    )
    upstream_keepalive_s: float = Field(
        default=4.0,
        gt=0,
        description=(
            "How long an idle connection to a replica is kept for reuse. Keep it below the engines' own idle "
            "timeout (vLLM closes an idle connection after 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a request sent on a "
            "connection the engine is closing fails and is retried on another replica, its cache lost."
        ),
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, description="Largest request body accepted.")
    max_retries: int = Field(default=2, ge=0, le=5, description="Retries on another replica before any byte.")
    max_concurrency: int = Field(default=4096, ge=1, description="Requests in flight before new ones get 429.")
    flow_control: bool | None = Field(
        default=None,
        description="Hold requests in the router while every replica is saturated (docs/flow-control.md); unset: "
        "the `flow.enabled` of replicas.yaml.",
    )

    health_interval_s: float = Field(default=2.0, gt=0, description="Active /health probe period.")
    metrics_interval_s: float = Field(default=1.0, gt=0, description="Engine /metrics scrape period.")
    breaker_failures: int = Field(default=3, ge=1, description="Consecutive failures that open a replica's breaker.")
    breaker_backoff_s: float = Field(default=1.0, gt=0, description="First breaker back-off; doubles per failure.")
    breaker_backoff_max_s: float = Field(default=30.0, gt=0, description="Longest breaker back-off.")
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="Time in-flight requests get on SIGTERM.")

    tokenizer_threads: int = Field(default=2, ge=1, le=64, description="Threads that tokenize requests.")
    tokenizer_inline_chars: int = Field(
        default=2048,
        ge=0,
        description=(
            "Text still to encode after the cached prefix, in characters, up to which a request tokenizes on the "
            "event loop (~0.5 ms at 2,048) instead of paying the hop to the threads; 0: every request on the threads."
        ),
    )
    provisional_ttl_s: float = Field(
        default=5.0, ge=0, description="How long a routed request's blocks count as cached before events confirm."
    )
    index_max_blocks: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Budget of block keys the prefix index tracks (~40-60 bytes each); beyond it the least recently stored "
            "or matched keys are evicted. Unset: no budget."
        ),
    )
    events_rcv_hwm: int = Field(
        default=1000,
        ge=1,
        description=(
            "KV-event messages queued per replica while ingest is behind (one message is one engine step's events); "
            "beyond it the engine's publisher holds them, then drops them: a counted seq gap, replayed or cleared."
        ),
    )
    events_silent_after_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "A replica sent requests that has published no KV event this long after the router began following it "
            "is logged as silent (wrong or unreachable kv_events endpoint). kvrouter_kv_event_age_seconds and "
            "/health show every replica's event age."
        ),
    )

    # The kv_aware policy's estimate of each replica's time to first token (kvrouter/policies/kv_aware.py). The
    # three costs are starting estimates that calibration replaces per replica (kvrouter/routing/calibration.py).
    kv_prefill_tokens_per_s: float = Field(
        default=10_000.0, gt=0, description="Starting estimate of a replica's prefill rate, uncached tokens/s."
    )
    kv_batch_tokens: int = Field(default=8192, ge=1, description="Prompt tokens an engine pass computes.")
    kv_decode_pass_s: float = Field(default=0.01, ge=0, description="Starting estimate of a pass's fixed cost.")
    kv_decode_s_per_request: float = Field(
        default=0.0005, ge=0, description="Starting estimate of the pass time per decoding request."
    )
    kv_calibrate: bool = Field(
        default=True,
        description=(
            "Learn each replica's prefill rate and pass costs from the TTFTs it delivers (/debug/route and "
            "kvrouter_kv_calibrated_* show them); false pins the three starting estimates above (the prefill rate "
            "x the replica's weight)."
        ),
    )
    kv_engine_metrics: bool = Field(
        default=True,
        description=(
            "With kv_calibrate: read each replica's prefill rate lower bound from its engine's /metrics "
            "(vllm:request_prefill_time_seconds and vllm:request_prefill_kv_computed_tokens); it replaces the "
            "starting estimate and raises a borrowed one until the replica has its own fit "
            "(kvrouter_kv_engine_prefill_tokens_per_s shows it). false: the router's own observations only."
        ),
    )
    kv_cache_weight: float | None = Field(
        default=None,
        ge=0,
        description=(
            "Worth of a cached token in prefill time saved; unset: 1 + the fleet's measured reuse (cached over "
            "computed prompt tokens), a number pins it."
        ),
    )
    kv_waiting_request_tokens: int = Field(
        default=0, ge=0, description="Tokens assumed per engine-reported waiting request this router did not send."
    )
    kv_hotspot_ratio: float = Field(default=2.0, gt=0, description="Load cap: this x the fleet's mean in flight...")
    kv_hotspot_slack: float = Field(default=8.0, ge=0, description="...plus this; above it cache credit is lost.")
    kv_session_bonus: float = Field(
        default=0.2,
        ge=0,
        description="Soft session hint (session_mode soft): the session's last replica wins when kv_aware's estimate "
        "there is within this share of the request's own prefill estimate of the best.",
    )
    kv_cpu_tier_credit: float = Field(
        default=0.75,
        ge=0,
        le=1,
        description="Share of a cached token's prefill saved when the engine loads it from CPU memory (an offload "
        "tier, its KV events' medium CPU); the rest counts as prefill work.",
    )
    kv_storage_tier_credit: float = Field(
        default=0.25, ge=0, le=1, description="The same for a token loaded from storage (medium DISK and the like)."
    )
    kv_tune: bool = Field(default=False, description="Tune kv_cache_weight online against measured TTFT.")
    kv_feedback: bool = Field(default=False, description="Correct the index with engine-reported cached tokens.")
    kv_survival: bool = Field(default=False, description="Credit cached blocks only if likely to survive the wait.")
    kv_lost_hits: bool = Field(
        default=False,
        description="A predicted prefix hit the engine evicts before admitting the request counts as prefill again "
        "in its replica's load (kvrouter/routing/lost_hits.py).",
    )

    # Session affinity hints (kvrouter/routing/sessions.py): the replica that served a session last.
    session_key_from: SessionKeySource = Field(
        default="both",
        description="Where a request's session key comes from: the x-session-id header, the OpenAI `user` field, "
        "both (the header first), or off.",
    )
    session_mode: SessionMode = Field(
        default="soft",
        description="soft: the session's last replica wins ties and small cost differences (kv_session_bonus); "
        "sticky: always the session's replica while it is routable; off: no hints.",
    )
    session_max: int = Field(default=65_536, ge=1, description="Sessions remembered (least recently seen go first).")
    session_ttl_s: float = Field(
        default=600.0, gt=0, description="A session idle this long is forgotten (its replica has likely evicted it)."
    )

    api_keys: list[str] = Field(default_factory=list, description="Accepted client Bearer keys (empty: open).")
    admin_token: str | None = Field(default=None, description="Bearer token for /admin and /debug endpoints.")
    forward_authorization: bool = Field(
        default=False, description="Forward the client's Authorization header to replicas."
    )
    log_prompts: bool = Field(default=False, description="Allow prompt text in logs.")

    # Hostile requests and replicas, upstream side (issue 15): what the proxy accepts from and sends to replicas.
    passthrough_paths: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PASSTHROUGH_PATHS),
        description=(
            "Paths passed through unchanged to one replica (vLLM's client-facing endpoints); an entry ending in /* "
            "also allows its sub-paths. Anything else is 404: vLLM's operator endpoints (/reset_prefix_cache, "
            "/sleep, /collective_rpc, ...) are never reachable through the router."
        ),
    )
    first_byte_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description=(
            "Longest wait for a replica's first response byte (a stream's first chunk) while the replica shows no "
            "progress on any request; past it the attempt is retried elsewhere and the replica is marked stalled."
        ),
    )
    assemble_non_streaming: bool = Field(
        default=True,
        description=(
            "Ask replicas for a stream when a client sends a non-streaming request of the common shape (one "
            "choice, no logprobs, tools or echo) and assemble the JSON answer the replica would have sent, so the "
            "router sees the first token and stops counting the prompt as pending prefill (exact accounting). The "
            "answer's layout is learned from one whole answer per replica. Off: requests are forwarded unchanged "
            "and their prompt counts as pending prefill until the whole answer arrives."
        ),
    )
    max_upstream_body_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Largest non-streaming answer read from a replica (else 502)."
    )
    max_scrape_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="Largest /metrics or /health body read from a replica."
    )
    # The client edge (issue 15, hostile clients; kvrouter/server/client_limits.py): what one client may hold.
    client_header_timeout_s: float = Field(
        default=10.0, gt=0, description="Time a client gets to send a request's line and headers once it began."
    )
    client_idle_timeout_s: float = Field(
        default=75.0, gt=0, description="An idle connection (no request begun) is closed after this long."
    )
    client_keepalive_requests: int = Field(
        default=1000,
        ge=0,
        description=(
            "A client connection is closed (Connection: close) after this many answers, so kept-alive connections "
            "spread again over the workers and router pods after a restart (nginx's keepalive_requests); 0: never."
        ),
    )
    client_body_timeout_s: float = Field(
        default=10.0, gt=0, description="Grace for a request body; a body that stays slower than the rate below..."
    )
    client_body_min_bytes_per_s: int = Field(
        default=16384, ge=1, description="...after the grace is cut off: 408 and the connection is closed."
    )
    max_client_connections: int = Field(
        default=4096,
        ge=1,
        description=(
            "Open client connections; beyond it a new one gets 503 and is closed (also capped by the process's "
            "file-descriptor limit, less 256 kept for replicas and Redis)."
        ),
    )
    client_body_buffer_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=1024,
        description="Request body bytes all clients together may have buffered while their bodies arrive; 429 beyond.",
    )
    max_prompt_chars: int = Field(
        default=1_000_000, ge=1, description="Largest prompt in characters (message contents), 413 before tokenizing."
    )
    max_prompt_tokens: int = Field(
        default=262_144, ge=1, description="Largest prompt in tokens (token-id prompts before, text after tokenizing)."
    )
    tokenizer_large_prompt_chars: int = Field(
        default=32_768, ge=1, description="Prompts longer than this tokenize on one separate thread, never in the way."
    )
    tokenizer_cache_bytes: int = Field(
        default=256 * 1024 * 1024, ge=0, description="Bytes the tokenizer's multi-turn render cache may hold."
    )
    tokenizer_large_queue: int = Field(
        default=8, ge=1, description="Large prompts tokenizing or waiting to; one more gets 429."
    )
