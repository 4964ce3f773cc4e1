"""The server's one validated settings object.

Every setting is read from an environment variable with the ``SCORING_`` prefix
(``SCORING_PORT=9000``), declared once here with its type, default and
description; the README's configuration table is checked against this class by
``tests/test_settings.py``. ``gunicorn.conf.py`` reads the same object, and
gunicorn's own command-line flags override what it sets (config file <
``GUNICORN_CMD_ARGS`` < command line).

Source: pydantic-settings ``BaseSettings``; the declare-once idea follows
gunicorn's ``config.py`` and Starlette's ``Config(env_prefix=...)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SCORING_"
#: ``SCORING_PEER_KEEPALIVE_S``'s default, seconds: aiohttp's ``keepalive_timeout``.
PEER_KEEPALIVE_S = 15.0


class Settings(BaseSettings):
    """Server settings; see each field's ``description`` (units are in the names)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # --- models -------------------------------------------------------------
    model_repository: Path = Field(
        Path("model_repository"),
        description="Folder with one subfolder per model (model.toml + weights).",
    )
    models: str = Field(
        "",
        description="Comma-separated model names to load from the repository; empty = all.",
    )

    # --- HTTP / gunicorn ----------------------------------------------------
    host: str = Field(
        "127.0.0.1",
        description="Address to bind. Binding anything but loopback is an explicit choice.",
    )
    port: int = Field(8080, ge=0, le=65535, description="TCP port to bind.")
    workers: int = Field(1, ge=1, description="Worker processes in CPU mode (no usable GPU).")
    max_processes_per_gpu: int = Field(
        1, ge=1, description="Workers per usable GPU; workers = GPUs x this in GPU mode."
    )
    timeout_s: int = Field(
        60, ge=1, description="Gunicorn worker timeout: a silent worker is killed after it."
    )
    graceful_timeout_s: int = Field(
        30, ge=1, description="Seconds a stopping worker gets to finish in-flight requests."
    )
    keepalive_s: int = Field(5, ge=0, description="HTTP keep-alive idle timeout, seconds.")
    max_requests_per_connection: int = Field(
        1000,
        ge=0,
        description="Requests served on one keep-alive connection before the server answers "
        "with Connection: close (nginx's keepalive_requests); 0 = no cap.",
    )
    impatient_hold_ms: float = Field(
        35.0,
        ge=0,
        le=1000,
        description="A 503 to a client that came back on the same connection before the "
        "previous 503's Retry-After had passed is held this long before it is sent, on a "
        "connection kept open: a client that resends at once then costs the server at most "
        "one refusal per hold, not one per round trip; 0 = no hold (such a 503 closes the "
        "connection instead). Each further such 503 in a row on the connection is held twice "
        "as long, up to impatient_hold_max_ms. Milliseconds.",
    )
    impatient_hold_max_ms: float = Field(
        280.0,
        ge=0,
        le=10000,
        description="The longest hold of a 503 to a client that keeps resending before "
        "Retry-After (the hold doubles from impatient_hold_ms with each such 503 in a row on "
        "a connection, and starts again once the connection gets any other answer or the "
        "client waits as asked); never shorter than impatient_hold_ms. Milliseconds.",
    )
    drain_grace_s: float = Field(
        1.0,
        ge=0,
        description="After SIGTERM or a max_requests recycle, how long a worker keeps accepting, "
        "unready and answering with Connection: close, before it closes its listener; longer "
        "(up to SCORING_DRAIN_MAX_HOLD_S) while a new sibling worker is still booting "
        "(docs/reliability.md).",
    )
    # --- worker process and balancing (app.server; issues 10 and 12) ---
    drain_max_hold_s: float = Field(
        300.0,
        ge=0,
        description="How long a draining worker keeps serving while no other worker is ready "
        "and a new one still boots or loads its models (a HUP reload with slow boots), seconds; "
        "a gunicorn master never kills a draining worker that keeps notifying it.",
    )
    balance: bool = Field(
        True,
        description="Balance connections among sibling workers through the run directory's "
        "load table: a worker busier than its least-loaded ready sibling stops accepting and "
        "sheds keep-alive connections (Connection: close) until that changes "
        "(docs/architecture.md).",
    )
    peer_keepalive_s: float = Field(
        PEER_KEEPALIVE_S,
        gt=0,
        description="How long a worker keeps an idle connection to a sibling's internal endpoint "
        "open for the next forwarded request or shard, seconds (a Unix socket: reopening costs <1 ms).",
    )
    hung_inference_s: float = Field(
        60.0,
        ge=0,
        description="A batch still running after this many seconds is reported (log, metric "
        "scoring_hung_batches_total) and its worker turns liveness 503 and restarts itself; "
        "0 = off.",
    )
    uvloop: bool = Field(
        False,
        description="Run workers on uvloop (app.server.worker.ScoringUVLoopWebWorker). Off by default: "
        "uvloop drops a SIGTERM that arrives while a worker boots, so a reload can leave an "
        "old worker holding its GPU slot (docs/architecture.md).",
    )
    max_requests: int = Field(0, ge=0, description="Recycle a worker after this many requests; 0 = never.")
    max_requests_jitter: int = Field(
        0, ge=0, description="Random extra requests added to max_requests per worker."
    )
    access_log: str = Field("-", description="Access log file ('-' = stderr, '' = off).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the server and gunicorn."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log line format of the server, gunicorn and access logs: 'text' or 'json' "
        "(one JSON object per line).",
    )

    # --- gRPC (KServe V2 / Triton GRPCInferenceService; docs/protocols.md) ----
    grpc_port: int = Field(
        8081,
        ge=0,
        le=65535,
        description="TCP port of the KServe V2 gRPC service (inference.GRPCInferenceService); "
        "every worker listens on it with SO_REUSEPORT, so the kernel spreads connections over "
        "the workers; 0 = no gRPC.",
    )
    grpc_host: str = Field(
        "127.0.0.1",
        description="Address the gRPC service binds. Binding anything but loopback is an explicit "
        "choice, as for host.",
    )
    grpc_max_connection_age_s: float = Field(
        60.0,
        ge=0,
        description="A gRPC connection is asked to reconnect (HTTP/2 GOAWAY, transparent to "
        "clients) after this many seconds, so a long-lived channel is placed again on a worker "
        "(SO_REUSEPORT); the calls in flight on it finish, each by its deadline; 0 = never.",
    )
    grpc_max_concurrent_streams: int = Field(
        100,
        ge=1,
        le=2**31 - 1,
        description="Most gRPC calls one connection may have open at once (HTTP/2 "
        "SETTINGS_MAX_CONCURRENT_STREAMS; a client queues the rest): bounds what one connection "
        "holds and arms grpcio's defences against HTTP/2 rapid reset (docs/reliability.md).",
    )
    grpc_servers: int = Field(
        4,
        ge=1,
        le=64,
        description="grpc.aio servers per worker, all on grpc_port (SO_REUSEPORT: the kernel "
        "spreads connections over every worker's servers). grpc.aio takes one new call per "
        "server per event-loop turn, so a busy worker with one server lets calls in one at a time "
        "(docs/benchmarks.md, Protocols); calls of one connection always reach one server.",
    )
    grpc_grace_s: float = Field(
        5.0,
        ge=0,
        description="When a worker stops (after its HTTP requests finished), how long its "
        "in-flight gRPC calls get to finish before they are cancelled, seconds (its clients get "
        "GOAWAY and move to another worker; docs/reliability.md, Drain).",
    )

    # --- security (docs/reliability.md) ---------------------------------------
    api_keys: SecretStr = Field(
        SecretStr(""),
        description="Comma-separated API keys; when this or api_keys_file gives any key, every "
        "request but health probes (and /metrics unless metrics_auth) needs one, as "
        "'Authorization: Bearer <key>' or 'X-API-Key: <key>'.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="File of API keys, one per line ('#' comments); re-read when it changes, so "
        "keys rotate without a restart.",
    )
    metrics_auth: bool = Field(
        True, description="With API keys configured, /metrics needs a key too; false = open to scrapers."
    )
    certfile: Path | None = Field(
        None, description="TLS certificate chain (PEM) to serve HTTPS; needs keyfile."
    )
    keyfile: Path | None = Field(None, description="TLS private key (PEM) of certfile.")
    client_ca_file: Path | None = Field(
        None,
        description="CA certificates (PEM) that sign client certificates: when set, HTTPS and "
        "gRPC both require a client certificate signed by one of them (mutual TLS); needs "
        "certfile and keyfile.",
    )

    # --- observability --------------------------------------------------------
    metrics_enabled: bool = Field(
        True, description="Serve Prometheus metrics at /metrics and record them."
    )
    gpu_metrics_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often each worker reads its bound GPU's memory and utilisation "
        "through NVML for /metrics, seconds.",
    )
    loop_lag_interval_ms: float = Field(
        20.0, ge=0, description="Event-loop lag probe period, ms (0: off); a stall of S ms shows "
        "as at least S minus this. Each tick wakes the loop (docs/observability.md).",
    )  # fmt: skip

    # --- requests: limits (docs/reliability.md) -------------------------------
    max_request_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest accepted request body, bytes (413 above)."
    )
    max_items_per_request: int = Field(
        4096,
        ge=1,
        description="Most items (rows along the batch dimension) in one request, for any model "
        "(413 above); each model's queue_capacity caps it further.",
    )
    max_string_bytes: int = Field(
        65536, ge=1, description="Longest BYTES element (one text) in UTF-8 bytes (413 above)."
    )
    max_json_depth: int = Field(
        32,
        ge=4,
        description="Deepest nesting of arrays and objects in a JSON request body, checked before "
        "decoding (400 above).",
    )
    max_header_bytes: int = Field(
        8190,
        ge=256,
        description="Longest request line or header field (name + value), bytes (431 above).",
    )
    max_headers: int = Field(100, ge=8, description="Most header fields in a request (431 above).")
    request_timeout_ms: float = Field(
        10_000.0,
        gt=0,
        description="Default deadline of an inference request, ms (504 when it passes); "
        "a model's timeout_ms or the request's own timeout overrides it.",
    )

    # --- admission, isolation, slow clients (area: admission; docs/reliability.md) ---
    max_request_timeout_ms: float = Field(
        60_000.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest deadline a client may ask for (X-Request-Timeout-Ms, V2 "
        "parameters.timeout, gRPC deadline), ms; longer ones are clipped to it. A model's "
        "max_timeout_ms overrides it.",
    )
    max_batch_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Most input bytes in one batch (the batch cost bound); larger requests are "
        "split across batches, and an item larger than this alone gets 413. A model's "
        "max_batch_bytes overrides it.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest time to receive a request body, seconds (408 and the connection "
        "closed after it).",
    )
    min_body_rate_bytes_s: float = Field(
        16 * 1024,
        ge=0,
        allow_inf_nan=False,
        description="Slowest accepted request-body upload after body_grace_s, bytes/s "
        "(408 below it); 0 = only body_timeout_s.",
    )
    body_grace_s: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds of a request body's upload before min_body_rate_bytes_s applies.",
    )

    # --- device / binding ---------------------------------------------------
    device: str = Field(
        "auto",
        description="Torch device for models: 'auto' (the GPU the worker is bound to, else cpu), "
        "'cpu', 'cuda:0'.",
    )
    torch_threads: int = Field(0, ge=0, description="torch.set_num_threads per worker; 0 = cores / workers.")
    gpus: str = Field(
        "",
        description="Comma-separated allow-list of GPUs (indices or UUIDs); empty = all visible.",
    )
    min_free_memory_mib: int = Field(
        0, ge=0, description="A GPU with less free memory (MiB) than this is not bound to."
    )
    foreign_process_policy: Literal["share", "skip"] = Field(
        "share", description="GPUs running processes that are not ours: 'share' or 'skip'."
    )
    bind_timeout_s: float = Field(
        60.0, gt=0, description="How long a worker waits for a free GPU slot before exiting."
    )
    strict_readiness: bool = Field(
        True,
        description="Readiness (GET /v2/health/ready) needs every model of the repository "
        "serving a warm version (Triton's --strict-readiness, on by default there too), so a "
        "model that cannot load keeps the pod unready (a new version that fails beside a "
        "serving one does not); false: ready once every model that can load is warm and at "
        "least one is, the others reported unavailable with their reason.",
    )
    model_load_retry_max_s: float = Field(
        300.0,
        ge=0,
        allow_inf_nan=False,
        description="A model that fails to load stays unavailable (503 with its reason) while the "
        "others serve, and its load is retried in the worker after 2 s, then twice as long each "
        "time, at most this many seconds apart; a load refused on the model's own files (a value "
        "its model.toml or handler refuses, a handler that does not import) is tried again only "
        "once a file of its folder changes; 0 = never retried (until a reload).",
    )
    model_control_mode: Literal["none", "explicit", "poll"] = Field(
        "none",
        description="How models change while the server runs (Triton's model control modes): 'none' "
        "(only a restart changes them; load/unload answer 400), 'explicit' (POST "
        "/v2/repository/models/{name}/load|unload and gRPC RepositoryModelLoad|Unload load, reload "
        "and unload a model on every worker), 'poll' (each worker scans the repository every "
        "repository_poll_s and loads, reloads and unloads what changed; the API is refused). "
        "Every mode first loads what SCORING_MODELS names (docs/model-control.md).",
    )
    repository_poll_s: float = Field(
        15.0,
        gt=0,
        allow_inf_nan=False,
        description="In model control mode 'poll': seconds between two scans of the model "
        "repository (Triton's --repository-poll-secs).",
    )
    run_dir: Path | None = Field(
        None,
        description="Per-server run directory (GPU leases, load table, shard sockets, metrics "
        "files): made private (0700) if it does not exist, refused unless it is a directory of "
        "this user closed to others; default: a fresh one (mkdtemp) in $XDG_RUNTIME_DIR or the "
        "temp dir.",
    )

    # --- response cache (app.serving.response_cache; docs/response-cache.md) ----------------
    response_cache_path: Path | None = Field(
        None,
        description="Folder of the response cache: one LMDB store per host that every worker "
        "shares, for the models whose model.toml has [response_cache] enable = true; default: "
        "response-cache in the run directory (kept across worker restarts; a fixed path also "
        "across server restarts).",
    )
    response_cache_bytes: int = Field(
        1 << 30,
        ge=1 << 20,
        description="Most bytes the response cache's file takes (LMDB's map size; entries hold at "
        "most half of it, the oldest evicted first), bytes.",
    )
    response_cache_ttl_s: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="A cached result older than this is computed again, seconds; 0 = kept until "
        "evicted (a new model version never reads an old one's results either way).",
    )

    response_cache_redis_url: str = Field(
        "",
        description="A Redis or Valkey server that several hosts share as the response cache's "
        "second tier (redis://host:port/db, rediss://, unix:///path.sock?db=0): asked for what "
        "the host's store lacks, written with "
        "what is computed; empty = none.",
    )
    response_cache_redis_timeout_ms: float = Field(
        50.0,
        gt=0,
        allow_inf_nan=False,
        description="Connect and socket timeout of each call to the response cache's Redis tier, "
        "ms; after a failed call the tier is skipped for 5 s (requests are computed).",
    )
    response_cache_lookup_timeout_ms: float = Field(
        100.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest a request waits for its response cache lookups (the host's store, "
        "then Redis), ms; past it the items not yet found are computed (counted in "
        "scoring_response_cache_late_items_total).",
    )

    @field_validator("model_repository", mode="after")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("SCORING_CERTFILE and SCORING_KEYFILE go together: set both or neither")
        if self.client_ca_file is not None and self.certfile is None:
            raise ValueError("SCORING_CLIENT_CA_FILE needs TLS: set SCORING_CERTFILE and SCORING_KEYFILE too")
        return self

    @property
    def api_key_list(self) -> tuple[str, ...]:
        """The keys of ``api_keys`` (the environment); the file's are read by ``app.http.auth``."""
        return tuple(k.strip() for k in self.api_keys.get_secret_value().split(",") if k.strip())

    @property
    def auth_enabled(self) -> bool:
        """True when API keys come from the environment or a file."""
        return bool(self.api_key_list) or self.api_keys_file is not None

    @property
    def model_names(self) -> tuple[str, ...]:
        """The ``models`` allow-list as a tuple; empty = every model in the repository."""
        return tuple(n.strip() for n in self.models.split(",") if n.strip())

    @property
    def gpu_allow_list(self) -> tuple[str, ...]:
        """The ``gpus`` allow-list as a tuple of indices or UUIDs."""
        return tuple(g.strip() for g in self.gpus.split(",") if g.strip())

    def for_workers(self, workers: int) -> Settings:
        """These settings in a server of ``workers`` worker processes (gunicorn's count: GPUs x
        ``max_processes_per_gpu``, or ``workers`` in CPU mode): ``torch_threads`` resolved for
        that count (:meth:`effective_torch_threads`)."""
        return self.model_copy(update={"torch_threads": self.effective_torch_threads(workers)})

    def effective_torch_threads(self, workers: int) -> int:
        """Intra-op threads per worker so that ``workers x threads`` fits the cores: the one rule
        (gunicorn.conf.py's ``post_fork`` applies it with the server's worker count)."""
        if self.torch_threads:
            return self.torch_threads
        return max(1, (os.cpu_count() or 1) // max(1, workers))
