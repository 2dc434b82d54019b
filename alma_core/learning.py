"""The learning protocol (architecture seed), as pure decisions over a finished run.

From a ``workflow.completed`` event and the run's event history:

* **the outcome**: counts, the failing node and error, and a text describing the
  run (workflow, task, outcome, failing node and error) that is embedded;
* **the strategy**: the path of nodes the run completed, in order. Runs of a
  workflow that took the same path are "the same strategy";
* **the error signature**: failing node, error type and the message with its
  variable parts (numbers, ids) masked, so the same failure groups together;
* **node outcomes**: one memory per node that failed in the run (the raw record);
* **heuristic**: once a strategy succeeded ``min_occurrences`` times (default 3)
  with confidence = successes / occurrences above ``min_confidence`` (0.5);
* **anti-pattern**: once ``anti_pattern_min_failures`` (2) runs failed with the
  same error signature.

Counts always come from the stored outcomes (recomputed, never incremented), so
applying the same run twice can never count it twice.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from alma_core.memory import MemoryKind, mask

_NAMESPACE = uuid.UUID("6f1c9a52-6c1e-4c43-9d3e-a1a5a0c0ffee")


@dataclass(frozen=True)
class LearningPolicy:
    min_occurrences: int = 3
    min_confidence: float = 0.5
    anti_pattern_min_failures: int = 2


@dataclass(frozen=True)
class HistoryEvent:
    """One event of the run's audit log, as the learner needs it."""

    type: str
    node_id: str | None
    branch_id: str | None = None
    error_type: str | None = None
    error_message: str | None = None


@dataclass(frozen=True)
class FinishedRun:
    """A ``workflow.completed`` event's facts."""

    tenant_id: str
    workflow_id: str
    run_id: str
    event_id: str
    success: bool
    duration_ms: int
    node_count: int
    nodes_succeeded: int
    nodes_failed: int
    workflow_version: str | None = None
    error_message: str | None = None
    task: str | None = None


@dataclass(frozen=True)
class MemoryDraft:
    """A memory to write, with the text its embedding is made from (``content``)."""

    tenant_id: str
    kind: MemoryKind
    dedupe_key: str
    content: str
    workflow_id: str | None = None
    run_id: str | None = None
    node_id: str | None = None
    condition: str | None = None
    strategy: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        """Stable: the same memory always has the same id (artifact links rely on it)."""
        return memory_id(self.tenant_id, self.kind, self.dedupe_key)


@dataclass(frozen=True)
class OutcomeDraft:
    """Everything the learner writes for one finished run, before the counts."""

    run: FinishedRun
    description: str
    strategy: str
    failing_node: str | None
    error_signature: str | None
    node_outcomes: list[MemoryDraft]
    heuristic: MemoryDraft  # written only once the counts allow it
    anti_pattern: MemoryDraft | None

    @property
    def id(self) -> str:
        return str(uuid.uuid5(_NAMESPACE, f"outcome\x1f{self.run.tenant_id}\x1f{self.run.run_id}"))

    def texts(self) -> list[str]:
        """Every text that needs an embedding, in a fixed order."""
        out = [self.description, self.heuristic.content]
        out += [m.content for m in self.node_outcomes]
        if self.anti_pattern is not None:
            out.append(self.anti_pattern.content)
        return out


def memory_id(tenant_id: str, kind: str, dedupe_key: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, f"{tenant_id}\x1f{kind}\x1f{dedupe_key}"))


def error_signature(node_id: str | None, error_type: str | None, message: str | None) -> str:
    raw = f"{node_id or '-'}\x1f{error_type or '-'}\x1f{mask(message or '')}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def strategy_of(history: list[HistoryEvent]) -> str:
    """The nodes the run completed, each once, in the order they first completed."""
    seen: dict[str, None] = {}
    for event in history:
        if event.type == "node.completed" and event.node_id and event.node_id not in seen:
            seen[event.node_id] = None
    return " → ".join(seen) or "(no completed node)"


def last_failure(history: list[HistoryEvent]) -> HistoryEvent | None:
    failures = [e for e in history if e.type == "node.failed"]
    return failures[-1] if failures else None


def describe(run: FinishedRun, failure: HistoryEvent | None) -> str:
    """The text embedded for the outcome: what a later task would be compared with."""
    version = f" (version {run.workflow_version})" if run.workflow_version else ""
    parts = [f"Workflow {run.workflow_id}{version}"]
    if run.task:
        parts.append(f"task: {run.task}")
    status = "succeeded" if run.success else "failed"
    parts.append(
        f"{status}: {run.nodes_succeeded} of {run.node_count} nodes succeeded, "
        f"{run.nodes_failed} failed, in {run.duration_ms / 1000:.1f} s"
    )
    if failure is not None and not run.success:
        parts.append(
            f"failing node {failure.node_id}: {failure.error_type}: {failure.error_message}"
        )
    elif run.error_message:
        parts.append(f"error: {run.error_message}")
    return ". ".join(parts)


def draft(run: FinishedRun, history: list[HistoryEvent]) -> OutcomeDraft:
    """What to write for a finished run (the counts decide later what else to learn)."""
    failure = last_failure(history)
    strategy = strategy_of(history)
    wf = run.workflow_id
    heuristic = MemoryDraft(
        tenant_id=run.tenant_id,
        kind=MemoryKind.HEURISTIC,
        dedupe_key=f"{wf}\x1f{strategy}",
        workflow_id=wf,
        content=f"In workflow {wf}, running the nodes {strategy} in this order succeeds",
        condition=f"workflow {wf}",
        strategy=strategy,
    )
    node_outcomes = []
    for event in history:
        if event.type != "node.failed" or not event.node_id:
            continue
        error = f"{event.error_type}: {event.error_message}"
        node_outcomes.append(
            MemoryDraft(
                tenant_id=run.tenant_id,
                kind=MemoryKind.OUTCOME,
                dedupe_key=f"{run.run_id}\x1f{event.node_id}\x1f"
                f"{error_signature(event.node_id, event.error_type, event.error_message)}",
                workflow_id=wf,
                run_id=run.run_id,
                node_id=event.node_id,
                content=f"In workflow {wf}, node {event.node_id} failed with {error}",
                condition=f"node {event.node_id} of workflow {wf}",
                metadata={
                    "error_type": event.error_type,
                    "error_signature": error_signature(
                        event.node_id, event.error_type, event.error_message
                    ),
                },
            )
        )
    signature = None
    anti_pattern = None
    if not run.success:
        node = failure.node_id if failure else None
        etype = failure.error_type if failure else None
        message = failure.error_message if failure else run.error_message
        signature = error_signature(node, etype, message)
        where = f"node {node} of workflow {wf}" if node else f"workflow {wf}"
        anti_pattern = MemoryDraft(
            tenant_id=run.tenant_id,
            kind=MemoryKind.ANTI_PATTERN,
            dedupe_key=f"{wf}\x1f{signature}",
            workflow_id=wf,
            node_id=node,
            content=f"Avoid: {where} fails with {etype or 'an error'}: {message or 'no message'}",
            condition=where,
            metadata={"error_type": etype, "error_signature": signature},
        )
    return OutcomeDraft(
        run=run,
        description=describe(run, failure),
        strategy=strategy,
        failing_node=failure.node_id if failure and not run.success else None,
        error_signature=signature,
        node_outcomes=node_outcomes,
        heuristic=heuristic,
        anti_pattern=anti_pattern,
    )


def heuristic_counts_qualify(occurrences: int, successes: int, policy: LearningPolicy) -> bool:
    """The seed's rule: enough successes, and more successes than not."""
    if occurrences <= 0:
        return False
    return successes >= policy.min_occurrences and successes / occurrences > policy.min_confidence


def anti_pattern_confidence(failures: int) -> float:
    """More repetitions, more certainty: 2 failures 0.4, 5 or more 1.0."""
    return min(1.0, failures / 5)


@dataclass(frozen=True)
class MemoryRow:
    """A memory to upsert with its counts (recomputed from the stored outcomes)."""

    draft: MemoryDraft
    occurrences: int
    successes: int
    confidence: float


@dataclass
class MemoryPlan:
    """What a batch of newly stored outcomes teaches: memories to upsert (one per id,
    the highest counts), heuristics whose strategy no longer qualifies (their counts
    and confidence refreshed, nothing else), and how many memories each outcome gave."""

    upserts: dict[str, MemoryRow] = field(default_factory=dict)
    fading: list[MemoryRow] = field(default_factory=list)
    learned: dict[str, int] = field(default_factory=dict)  # outcome id -> memories


Counts = dict[tuple[str, str, str], tuple[int, int]]  # (tenant, workflow, key) -> (n, hits)


def plan_memories(
    stored: list[OutcomeDraft], strategies: Counts, failures: Counts, policy: LearningPolicy
) -> MemoryPlan:
    """Decide, from the counts of every stored outcome (this batch's included):

    * each failed node of a run is a node outcome (occurrences 1);
    * a strategy whose successes qualify (:func:`heuristic_counts_qualify`) is a
      heuristic with those counts; one that stopped qualifying only has its counts
      refreshed (a failed run of it, say);
    * an error signature seen in ``anti_pattern_min_failures`` failed runs is an
      anti-pattern, more certain the more often it was seen.

    ``strategies`` hold (runs, successes) per strategy, ``failures`` (runs, failures)
    per error signature."""
    plan = MemoryPlan()
    rows: list[MemoryRow] = []
    for d in stored:
        learned = 0
        for m in d.node_outcomes:
            rows.append(MemoryRow(m, 1, 0, 1.0))
            learned += 1
        occurrences, successes = strategies.get(
            (d.run.tenant_id, d.run.workflow_id, d.strategy), (0, 0)
        )
        confidence = successes / max(1, occurrences)
        heuristic = MemoryRow(d.heuristic, occurrences, successes, confidence)
        if heuristic_counts_qualify(occurrences, successes, policy):
            rows.append(heuristic)
            learned += 1 if d.run.success else 0  # a failed run only refreshes the counts
        else:
            plan.fading.append(heuristic)
        if d.anti_pattern is not None and d.error_signature is not None:
            _, failed = failures.get(
                (d.run.tenant_id, d.run.workflow_id, d.error_signature), (0, 0)
            )
            if failed >= policy.anti_pattern_min_failures:
                rows.append(MemoryRow(d.anti_pattern, failed, 0, anti_pattern_confidence(failed)))
                learned += 1
        plan.learned[d.id] = learned
    for row in rows:  # one row per memory: the last (highest counts) wins
        plan.upserts[row.draft.id] = row
    return plan
