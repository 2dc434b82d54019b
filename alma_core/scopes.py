"""Which rows a retrieval scope admits. Two rules hold for every scope (docs/guarantees.md §6,
tenant isolation):

* every scope is filtered by tenant, RUN and NODE included (a run id alone would
  admit another tenant's run of the same name); GLOBAL, which reads across
  tenants, exists only when multi-tenant mode is off;
* a scope whose context lacks the field it filters on is an error, never an
  empty filter (which would admit everything).

| scope    | memories                              | workflow outcomes          |
|----------|---------------------------------------|----------------------------|
| NODE     | tenant, run, node                     | tenant, workflow           |
| RUN      | tenant, run                           | tenant, workflow           |
| WORKFLOW | tenant, workflow                      | tenant, workflow           |
| AGENT    | tenant, agent                         | tenant (+ workflow if set) |
| TENANT   | tenant                                | tenant (+ workflow if set) |
| GLOBAL   | nothing (single-tenant mode only)     | workflow if set            |

Workflow outcomes are whole runs, so narrower scopes than the workflow read the
outcomes of the context's tenant and workflow.
"""

from __future__ import annotations

from dataclasses import dataclass

from alma_core import errors
from alma_core.types import RetrievalScope, WorkflowContext

COLUMNS = ("tenant_id", "workflow_id", "run_id", "node_id", "agent")


@dataclass(frozen=True)
class ScopeFilter:
    """Equality conditions on scope columns; ``all_tenants`` only for GLOBAL."""

    conditions: tuple[tuple[str, str], ...]
    all_tenants: bool = False
    tenant_id: str | None = None

    def admits(self, row: dict[str, object]) -> bool:
        """The same filter in Python (the tests' brute-force reference)."""
        return all(row.get(column) == value for column, value in self.conditions)

    def columns(self) -> frozenset[str]:
        """The columns the filter compares."""
        return frozenset(c for c, _ in self.conditions)

    def sql(self, first_param: int, alias: str = "") -> tuple[str, list[str]]:
        """``col = $n AND ...`` (or ``TRUE``) and its arguments."""
        prefix = f"{alias}." if alias else ""
        parts = [f"{prefix}{c} = ${first_param + i}" for i, (c, _) in enumerate(self.conditions)]
        return (" AND ".join(parts) or "TRUE"), [v for _, v in self.conditions]


def _need(value: str | None, scope: RetrievalScope, what: str) -> str:
    if not value:
        raise errors.ContextError(f"the {scope.value.upper()} scope needs {what} in the context")
    return value


def memory_filter(
    context: WorkflowContext,
    scope: RetrievalScope,
    *,
    agent: str | None = None,
    require_tenant: bool = True,
) -> ScopeFilter:
    context.validate(require_tenant=require_tenant)
    if scope is RetrievalScope.GLOBAL:
        if require_tenant:
            raise errors.ContextError(
                "the GLOBAL scope reads across tenants and is refused in multi-tenant mode "
                "(ALMA_REQUIRE_TENANT=true); use the TENANT scope"
            )
        return ScopeFilter((), all_tenants=True)
    tenant = _need(context.tenant_id, scope, "tenant_id")
    conds: list[tuple[str, str]] = [("tenant_id", tenant)]
    if scope is RetrievalScope.NODE:
        conds += [
            ("run_id", _need(context.run_id, scope, "run_id")),
            ("node_id", _need(context.node_id, scope, "node_id")),
        ]
    elif scope is RetrievalScope.RUN:
        conds.append(("run_id", _need(context.run_id, scope, "run_id")))
    elif scope is RetrievalScope.WORKFLOW:
        conds.append(("workflow_id", _need(context.workflow_id, scope, "workflow_id")))
    elif scope is RetrievalScope.AGENT:
        conds.append(("agent", _need(agent, scope, "an agent")))
    return ScopeFilter(tuple(conds), tenant_id=tenant)


def outcome_filter(context: WorkflowContext, memories: ScopeFilter) -> ScopeFilter:
    """Workflow outcomes: the context's tenant (as for memories) and workflow."""
    conds = [c for c in memories.conditions if c[0] == "tenant_id"]
    if context.workflow_id:
        conds.append(("workflow_id", context.workflow_id))
    return ScopeFilter(tuple(conds), memories.all_tenants, memories.tenant_id)
