"""The version-1 event contract: the envelope and one payload per event type.

Every model forbids unknown fields: a typo such as ``udpates`` is a schema
violation, not a silently ignored key. A new, incompatible contract gets a new
topic (``alma.lifecycle.v2``) rather than a looser v1.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    model_validator,
)

CONTRACT_VERSION = 1

Id = Annotated[str, StringConstraints(min_length=1, max_length=256)]
JsonObject = dict[str, Any]


class EventType(StrEnum):
    NODE_STARTED = "node.started"
    NODE_COMPLETED = "node.completed"
    NODE_FAILED = "node.failed"
    BRANCH_JOIN = "branch.join"
    WORKFLOW_COMPLETED = "workflow.completed"
    # 1.2, additive: a LangGraph thread's checkpoints, pending writes and upkeep, so a
    # LangGraph checkpointer writes through the pipeline (alma_core.integrations.langgraph)
    GRAPH_CHECKPOINT = "graph.checkpoint"
    GRAPH_WRITES = "graph.writes"
    GRAPH_UPKEEP = "graph.upkeep"


class _Model(BaseModel):
    # strict: no silent coercion ("3" is not 3, "true" is not True); timestamps
    # are the one exception, since JSON carries them as RFC 3339 strings.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


Timestamp = Annotated[AwareDatetime, Field(strict=False)]

# Counters and sequence numbers are stored as PostgreSQL bigint (attempts as integer):
# a larger number is a schema violation here, not an overflow in the database.
BIGINT_MAX = 2**63 - 1
INTEGER_MAX = 2**31 - 1


# --- payloads ---------------------------------------------------------------


class NodeStartedPayload(_Model):
    """Recorded for the run's audit trail and metrics; no checkpoint."""

    attempt: int | None = Field(default=None, ge=1, le=INTEGER_MAX)
    input: JsonObject | None = None


class NodeCompletedPayload(_Model):
    """Exactly one of ``state`` (the full state) or ``updates`` (applied with reducers)."""

    state: JsonObject | None = None
    updates: JsonObject | None = None
    expected_seq: int | None = Field(
        default=None,
        ge=0,
        le=BIGINT_MAX,
        description="Optimistic concurrency: rejected unless the run's latest seq equals this.",
    )
    metadata: JsonObject | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> NodeCompletedPayload:
        if (self.state is None) == (self.updates is None):
            raise ValueError("exactly one of 'state' or 'updates' is required")
        return self


class ErrorInfo(_Model):
    type: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    message: Annotated[str, StringConstraints(max_length=65536)]


class NodeFailedPayload(_Model):
    """A failure checkpoint; ``state`` or ``updates`` (at most one) record what the node had.
    ``attempt`` (optional, added in 1.1) says which attempt failed when the orchestrator
    retries nodes; it is kept in the checkpoint's metadata."""

    error: ErrorInfo
    attempt: int | None = Field(default=None, ge=1, le=INTEGER_MAX)
    state: JsonObject | None = None
    updates: JsonObject | None = None

    @model_validator(mode="after")
    def _at_most_one(self) -> NodeFailedPayload:
        if self.state is not None and self.updates is not None:
            raise ValueError("at most one of 'state' or 'updates' may be given")
        return self


ReducerName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class BranchJoinPayload(_Model):
    """Merge the latest states of ``branch_ids`` (in that order) or the given ``states``."""

    join_id: Id
    branch_ids: (
        Annotated[
            list[Id],
            Field(min_length=1, max_length=1024, json_schema_extra={"uniqueItems": True}),
        ]
        | None
    ) = None
    states: Annotated[list[JsonObject], Field(min_length=1, max_length=1024)] | None = None
    reducers: dict[str, ReducerName] | None = Field(
        default=None,
        description="Reducer per field. When absent, the workflow's registered configuration.",
    )
    default_reducer: ReducerName | None = None
    strict: bool | None = None
    reply_to: (
        Annotated[
            str, StringConstraints(min_length=1, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$")
        ]
        | None
    ) = Field(
        default=None,
        description="Reply topic; the configured merged topic when absent (with tenant "
        "topics: the tenant's own, the only one allowed).",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> BranchJoinPayload:
        if (self.branch_ids is None) == (self.states is None):
            raise ValueError("exactly one of 'branch_ids' or 'states' is required")
        seen: set[str] = set()
        for branch in self.branch_ids or ():
            if branch in seen:  # a reducer like sum would count it twice
                raise ValueError(f"'branch_ids' names {branch!r} twice: each branch merges once")
            seen.add(branch)
        return self


class ArtifactRef(_Model):
    """A workflow artifact kept in blob storage; ALMA keeps the reference only."""

    id: Id
    artifact_type: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    storage_path: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    content_hash: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    size_bytes: int = Field(ge=0, le=BIGINT_MAX)
    created_at: Timestamp | None = None
    metadata: JsonObject = Field(default_factory=dict)


class WorkflowCompletedPayload(_Model):
    outcome: Literal["success", "failure"]
    duration_ms: int = Field(ge=0, le=BIGINT_MAX)
    node_count: int = Field(ge=0, le=BIGINT_MAX)
    nodes_succeeded: int = Field(ge=0, le=BIGINT_MAX)
    nodes_failed: int = Field(ge=0, le=BIGINT_MAX)
    error_message: str | None = None
    task: str | None = Field(default=None, max_length=65536)
    artifacts: list[ArtifactRef] = Field(default_factory=list, max_length=1024)
    cleanup_checkpoints: bool | None = None

    @model_validator(mode="after")
    def _counts(self) -> WorkflowCompletedPayload:
        if self.nodes_succeeded + self.nodes_failed > self.node_count:
            raise ValueError("nodes_succeeded + nodes_failed exceeds node_count")
        return self


# --- LangGraph threads (1.2) ------------------------------------------------
# A thread is a run (run_id = thread_id); its checkpoints live in their own tables
# beside the run's audit trail. Channel values are LangGraph's serializer output, which
# is not always JSON: each is carried as its type name and its bytes in base64.

Namespace = Annotated[str, StringConstraints(max_length=1024)]


class SerializedValue(_Model):
    """A value as LangGraph's serializer wrote it: ``dumps_typed`` → (type, bytes)."""

    type: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    data: str = Field(description="The bytes, base64 (empty for the type 'empty').")


class GraphCheckpointPayload(_Model):
    """A LangGraph checkpoint: its fields but the channel values (JSON), the values of
    the channels this checkpoint changed (``new_versions``), and its metadata."""

    checkpoint_ns: Namespace = ""
    checkpoint_id: Id
    parent_checkpoint_id: Id | None = None
    checkpoint: JsonObject = Field(description="v, id, ts, channel_versions, versions_seen...")
    values: dict[str, SerializedValue] = Field(
        default_factory=dict, description="channel -> its value at the version in new_versions"
    )
    new_versions: dict[str, str | int | float] = Field(default_factory=dict)
    metadata: JsonObject = Field(default_factory=dict)


class GraphWrite(_Model):
    idx: int = Field(ge=-(2**31), le=INTEGER_MAX)
    channel: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    value: SerializedValue


class GraphWritesPayload(_Model):
    """A task's pending writes against a checkpoint (``put_writes``)."""

    checkpoint_ns: Namespace = ""
    checkpoint_id: Id
    task_id: Id
    task_path: Annotated[str, StringConstraints(max_length=4096)] = ""
    writes: Annotated[list[GraphWrite], Field(max_length=100_000)]
    replace: bool = Field(
        default=False, description="special channels (errors, interrupts): the last write wins"
    )
    error: ErrorInfo | None = Field(
        default=None, description="the task failed: its error, for the audit log and learning"
    )


class GraphUpkeepPayload(_Model):
    """What a LangGraph checkpointer does to a whole thread: delete it, delete the
    checkpoints of some LangGraph runs, prune it, or copy it to another thread."""

    op: Literal["delete_thread", "delete_runs", "prune", "copy"]
    run_ids: Annotated[list[Id], Field(max_length=10_000)] | None = None
    strategy: Literal["keep_latest", "delete"] | None = None
    target_thread_id: Id | None = None

    @model_validator(mode="after")
    def _arguments(self) -> GraphUpkeepPayload:
        needs = {"delete_runs": "run_ids", "prune": "strategy", "copy": "target_thread_id"}
        field = needs.get(self.op)
        if field is not None and getattr(self, field) is None:
            raise ValueError(f"{self.op} needs {field}")
        return self

    @property
    def deletes_thread(self) -> bool:
        """Whether it deletes the whole thread (which frees its id for another graph)."""
        return self.op == "delete_thread" or (self.op == "prune" and self.strategy == "delete")


# --- envelope ---------------------------------------------------------------


class _Envelope(_Model):
    event_id: Id = Field(description="Unique per event; the idempotency key.")
    emitted_at: Timestamp = Field(description="RFC 3339, set by the publisher.")
    tenant_id: Id
    workflow_id: Id
    run_id: Id = Field(description="Also the record key.")
    workflow_version: Annotated[str, StringConstraints(max_length=128)] | None = None
    branch_id: Id | None = None


class _NodeEnvelope(_Envelope):
    node_id: Id


class NodeStarted(_NodeEnvelope):
    type: Literal["node.started"]
    payload: NodeStartedPayload = Field(default_factory=NodeStartedPayload)


class NodeCompleted(_NodeEnvelope):
    type: Literal["node.completed"]
    payload: NodeCompletedPayload


class NodeFailed(_NodeEnvelope):
    type: Literal["node.failed"]
    payload: NodeFailedPayload


class BranchJoin(_Envelope):
    type: Literal["branch.join"]
    node_id: Id | None = None
    payload: BranchJoinPayload


class WorkflowCompleted(_Envelope):
    type: Literal["workflow.completed"]
    node_id: Id | None = None
    payload: WorkflowCompletedPayload


class GraphCheckpoint(_Envelope):
    type: Literal["graph.checkpoint"]
    node_id: Id | None = None
    payload: GraphCheckpointPayload


class GraphWrites(_Envelope):
    type: Literal["graph.writes"]
    node_id: Id | None = None  # the node whose task wrote them, when known
    payload: GraphWritesPayload


class GraphUpkeep(_Envelope):
    type: Literal["graph.upkeep"]
    node_id: Id | None = None
    payload: GraphUpkeepPayload


Event = Annotated[
    NodeStarted
    | NodeCompleted
    | NodeFailed
    | BranchJoin
    | WorkflowCompleted
    | GraphCheckpoint
    | GraphWrites
    | GraphUpkeep,
    Field(discriminator="type"),
]
GRAPH_EVENTS = (GraphCheckpoint, GraphWrites, GraphUpkeep)

EVENT_MODELS: dict[EventType, type[_Envelope]] = {
    EventType.NODE_STARTED: NodeStarted,
    EventType.NODE_COMPLETED: NodeCompleted,
    EventType.NODE_FAILED: NodeFailed,
    EventType.BRANCH_JOIN: BranchJoin,
    EventType.WORKFLOW_COMPLETED: WorkflowCompleted,
    EventType.GRAPH_CHECKPOINT: GraphCheckpoint,
    EventType.GRAPH_WRITES: GraphWrites,
    EventType.GRAPH_UPKEEP: GraphUpkeep,
}

event_adapter: TypeAdapter[Event] = TypeAdapter(Event)


# --- replies ----------------------------------------------------------------


class MergeReply(_Model):
    """The joiner's answer on ``reply_to``, keyed by ``run_id``."""

    join_id: Id
    run_id: Id
    tenant_id: Id
    status: Literal["ok", "error"]
    merged_state: JsonObject | None = None
    checkpoint_seq: int | None = Field(default=None, ge=1, le=BIGINT_MAX)
    error: str | None = None

    @model_validator(mode="after")
    def _status_fields(self) -> MergeReply:
        if self.status == "ok" and (self.merged_state is None or self.checkpoint_seq is None):
            raise ValueError("an ok reply carries merged_state and checkpoint_seq")
        if self.status == "error" and not self.error:
            raise ValueError("an error reply carries error")
        return self


def encode(event: BaseModel) -> bytes:
    """The wire form of an event or reply: compact JSON, UTF-8, nulls left out."""
    return event.model_dump_json(exclude_none=True, by_alias=True).encode()
