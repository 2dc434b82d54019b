"""How a Temporal workflow run maps onto ALMA Stream's lifecycle events: pure rules
shared by the workflow side and the worker side (no I/O, nothing of temporalio).

| ALMA                 | Temporal                                                     |
|----------------------|--------------------------------------------------------------|
| ``tenant_id``        | the workflow's memo ``alma.tenant_id``, else the plugin's     |
|                      | ``tenant_id`` (a name, or a function of the workflow's info), |
|                      | else the namespace                                           |
| ``workflow_id``      | the workflow type (what learning and retrieval group by)      |
| ``workflow_version`` | memo ``alma.workflow_version``, else the plugin's setting     |
| ``run_id``           | ``<workflow id>/<run id>`` (a continue-as-new is a new run)   |
| ``node_id``          | the activity type, or the name the author gives               |
| ``branch_id``        | the branch the author gives (parallel activities), else none  |
| ``event_id``         | derived from Temporal's identity of the step (below)          |

Event ids are ``t-<hash of namespace, workflow id, run id, activity id>-<kind>``: a
``node.started`` and a ``node.failed`` per attempt (``-started-2``), one
``node.completed`` per activity (Temporal completes an activity once; an attempt that
published its completion and then crashed is followed by a retry whose completion is
the same event, which the inbox drops), one ``workflow.completed`` per run. A
replayed workflow publishes nothing: its activities' results come from history.

An activity's result becomes the node's ``updates`` (folded into the run's state with
the workflow's reducers) unless the author says ``result="state"`` (the result is the
whole state) or ``result="ignore"`` (recorded, no state). A dict is used as it is;
anything else goes under ``key`` (default: the node id); ``fields`` keeps only those
keys of a dict.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from temporalio.converter import PayloadConverter

from alma_core import errors
from alma_core.types import WorkflowContext

HEADER = "alma-node"  # the Temporal header carrying an activity's ALMA context
MEMO_TENANT = "alma.tenant_id"
MEMO_VERSION = "alma.workflow_version"
MEMO_TASK = "alma.task"
INTERNAL_PREFIX = "alma."  # ALMA's own activities (alma.join, ...) are not nodes
PATCH_LOCAL_COMPLETE = "alma-complete-local"  # workflow.patched: alma.complete runs locally
ID_LIMIT = 256  # the contract's longest id

ResultMode = Literal["updates", "state", "ignore"]


class ResultNotJson(errors.AlmaError):
    """An activity's result cannot be recorded as JSON."""

    reason = "result_not_json"


@dataclass(frozen=True)
class NodeOptions:
    """What the workflow author says about one activity (all optional)."""

    node_id: str | None = None
    branch_id: str | None = None
    result: ResultMode = "updates"
    key: str | None = None
    fields: tuple[str, ...] | None = None


@dataclass(frozen=True)
class NodeHeader:
    """An activity's ALMA context, sent from the workflow in the ``alma-node`` header."""

    tenant_id: str
    workflow_id: str
    run_id: str
    workflow_version: str | None = None
    node_id: str | None = None
    branch_id: str | None = None
    result: ResultMode = "updates"
    key: str | None = None
    fields: list[str] | None = field(default=None)

    def to_doc(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> NodeHeader:
        known = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def context(self, node_id: str) -> WorkflowContext:
        return WorkflowContext(
            tenant_id=self.tenant_id,
            workflow_id=self.workflow_id,
            workflow_version=self.workflow_version,
            run_id=self.run_id,
            node_id=self.node_id or node_id,
            branch_id=self.branch_id,
        )


def run_id(workflow_id: str, temporal_run_id: str) -> str:
    """The ALMA run of one Temporal run; an over-long workflow id is hashed."""
    joined = f"{workflow_id}/{temporal_run_id}"
    if len(joined) <= ID_LIMIT:
        return joined
    return f"{hashlib.sha256(workflow_id.encode()).hexdigest()[:32]}/{temporal_run_id}"


def event_id(
    namespace: str,
    workflow_id: str,
    temporal_run_id: str,
    step: str,
    kind: str,
    attempt: int | None = None,
) -> str:
    """A lifecycle event's id, the same whenever Temporal repeats the same step."""
    base = "\x1f".join((namespace, workflow_id, temporal_run_id, step))
    digest = hashlib.sha256(base.encode()).hexdigest()[:40]
    return f"t-{digest}-{kind}" + (f"-{attempt}" if attempt is not None else "")


def node_payload(value: Any, header: NodeHeader, node_id: str) -> dict[str, Any] | None:
    """The ``node.completed`` payload for an activity's result (already converted to
    plain JSON values): ``{"updates": ...}``, ``{"state": ...}``, or None for
    ``result="ignore"``. Raises :class:`ResultNotJson` for a result that cannot be a
    state."""
    if header.result == "ignore":
        return None
    if value is None:
        doc: dict[str, Any] = {}
    elif isinstance(value, dict) and header.key is None:
        doc = value
    else:
        doc = {header.key or node_id: value}
    if header.fields is not None:
        if not isinstance(value, dict):
            raise ResultNotJson(
                f"activity {node_id!r} returned {type(value).__name__}, but fields= asks for "
                "keys of a dict"
            )
        doc = {k: doc[k] for k in header.fields if k in doc}
    if header.result == "state":
        return {"state": doc}
    return {"updates": doc}


def checked_json(value: Any, node_id: str) -> Any:
    """``value`` (already plain JSON values) if it is JSON ALMA accepts: no NaN or
    infinity. Else :class:`ResultNotJson`, saying what to do."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ResultNotJson(
            f"activity {node_id!r} returned a {type(value).__name__} that is not JSON "
            f"({exc}); return a dict, a dataclass or a pydantic model of JSON values, or "
            "pass result='ignore' for this node"
        ) from None
    return value


# --- what the workflow asks of ALMA's own activities ---------------------------------


@dataclass
class JoinRequest:
    """``alma.join``: merge branches (or states) with reducers; the merged state back."""

    join_id: str
    branch_ids: list[str] | None = None
    states: list[dict[str, Any]] | None = None
    reducers: dict[str, str] | None = None
    default_reducer: str | None = None
    strict: bool | None = None
    node_id: str = "join"
    timeout_s: float = 30.0


@dataclass
class CompleteRequest:
    """``alma.complete``: the run's ``workflow.completed``, counted by the workflow."""

    success: bool
    duration_ms: int
    node_count: int
    nodes_succeeded: int
    nodes_failed: int
    error_message: str | None = None
    task: str | None = None
    artifacts: list[dict[str, Any]] | None = None
    cleanup_checkpoints: bool | None = None


@dataclass
class ResumeRequest:
    """``alma.resume``: where an ALMA run stands (a Temporal run of this workflow id)."""

    temporal_run_id: str


@dataclass
class Head:
    """A branch head or the main line, as ``alma.resume`` returns it."""

    seq: int
    node_id: str | None
    state: dict[str, Any]


@dataclass
class ResumePoint:
    """What ``alma.resume`` returns: the latest checkpoint's node, seq and kind (``node``,
    ``failure``: the run stopped at that node's failure, ``merge``), the main line's
    state, and every branch's head (empty for a run with no checkpoint)."""

    run_id: str
    seq: int = 0
    node_id: str | None = None
    kind: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    branches: dict[str, Head] = field(default_factory=dict)


def as_json(result: Any, node_id: str, converter: PayloadConverter) -> Any:
    """The result as JSON values, through the worker's own payload converter (so a
    dataclass or a pydantic model becomes what the workflow receives, and bytes inside
    a result a list of integers, as Temporal's JSON converter makes them). A result the
    converter cannot make JSON (bytes themselves, say) is :class:`ResultNotJson`."""
    if result is None:
        return None
    try:
        payload = converter.to_payload(result)
    except Exception as exc:  # noqa: BLE001 - any converter failure means "not JSON"
        raise ResultNotJson(
            f"activity {node_id!r} returned a {type(result).__name__} that cannot be "
            f"converted ({exc}); return JSON values, a dataclass or a pydantic model, "
            "or pass result='ignore' for this node"
        ) from None
    encoding = payload.metadata.get("encoding", b"").decode()
    if encoding not in ("json/plain", "json/protobuf"):
        raise ResultNotJson(
            f"activity {node_id!r} returned {type(result).__name__}, stored as {encoding} "
            "(not JSON); return JSON values or pass result='ignore' for this node"
        )
    return checked_json(json.loads(payload.data), node_id)
