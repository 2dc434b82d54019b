"""Domain types: the workflow context, retrieval scopes, checkpoints and the dead letters
that block a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from alma_core import errors


class RetrievalScope(StrEnum):
    """How wide a retrieval looks, from one node to the whole platform."""

    NODE = "node"
    RUN = "run"
    WORKFLOW = "workflow"
    AGENT = "agent"
    TENANT = "tenant"
    GLOBAL = "global"


@dataclass(frozen=True)
class WorkflowContext:
    """Where an operation happens: tenant > workflow > run > node."""

    tenant_id: str | None = None
    workflow_id: str | None = None
    workflow_version: str | None = None
    run_id: str | None = None
    node_id: str | None = None
    branch_id: str | None = None

    def validate(self, require_tenant: bool = False) -> WorkflowContext:
        """Check the hierarchy; ``require_tenant`` is multi-tenant mode."""
        if self.run_id and not self.workflow_id:
            raise errors.ContextError("run_id requires workflow_id")
        if self.node_id and not self.run_id:
            raise errors.ContextError("node_id requires run_id")
        if self.branch_id and not self.run_id:
            raise errors.ContextError("branch_id requires run_id")
        if require_tenant and not self.tenant_id:
            raise errors.ContextError(
                "tenant_id is required in multi-tenant mode (ALMA_REQUIRE_TENANT=true); "
                "pass a tenant or set ALMA_REQUIRE_TENANT=false"
            )
        return self


@dataclass(frozen=True)
class Checkpoint:
    """One durable state of a run. ``seq`` is gapless per run, starting at 1."""

    run_id: str
    tenant_id: str
    seq: int
    state: dict[str, Any]
    state_hash: str
    size_bytes: int
    kind: str = "node"
    node_id: str | None = None
    branch_id: str | None = None
    parent_seq: int | None = None
    event_id: str | None = None
    merged_from: tuple[int, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None


@dataclass(frozen=True)
class BlockingLetter:
    """A dead letter of one of a run's events that the run waits on (docs/guarantees.md
    §11): replay it (``alma dlq replay ID``) once what refused it is fixed, or have the
    orchestrator send what comes next."""

    id: int
    reason: str
    detail: str
    event_id: str | None
    created_at: datetime
