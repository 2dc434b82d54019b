"""What ALMA Stream remembers and hands back: memories, workflow outcomes, and the
``MemorySlice`` a retrieval returns, with ``to_prompt`` for an agent's context.

Pure types: no I/O. ``score`` and ``similarity`` are filled in by retrieval.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from alma_core.types import RetrievalScope

_MASKS = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I), "<id>"),
    (re.compile(r"\b0x[0-9a-f]+\b", re.I), "<hex>"),
    (re.compile(r"\b[0-9a-f]{16,}\b", re.I), "<hex>"),
    (re.compile(r"\d+(\.\d+)?"), "<n>"),
    (re.compile(r"\s+"), " "),
]


def mask(message: str) -> str:
    """The text with its variable parts (ids, hex, numbers) masked, lower-cased, at
    most 300 characters: what stays the same when the same thing happens again."""
    text = message.strip().lower()
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return text[:300]


class MemoryKind(StrEnum):
    HEURISTIC = "heuristic"  # "in workflow W, doing X succeeds" (learned from repeated success)
    ANTI_PATTERN = "anti_pattern"  # "node N fails with E" (learned from repeated failure)
    DOMAIN_KNOWLEDGE = "domain_knowledge"
    PREFERENCE = "preference"
    OUTCOME = "outcome"  # what one node of one run did: the raw record


@dataclass(frozen=True)
class ArtifactLink:
    """An artifact kept in blob storage, linked to an outcome or a memory."""

    artifact_id: str
    artifact_type: str
    storage_path: str
    content_hash: str
    size_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Memory:
    id: str
    tenant_id: str
    kind: MemoryKind
    content: str
    agent: str | None = None
    workflow_id: str | None = None
    run_id: str | None = None
    node_id: str | None = None
    condition: str | None = None
    strategy: str | None = None
    occurrences: int = 1
    successes: int = 0
    confidence: float = 0.0
    created_at: datetime | None = None
    updated_at: datetime | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    artifacts: tuple[ArtifactLink, ...] = ()
    similarity: float = 0.0
    score: float = 0.0


@dataclass(frozen=True)
class WorkflowOutcome:
    """How one run of a workflow ended, with the text its embedding was made from."""

    id: str
    tenant_id: str
    workflow_id: str
    run_id: str
    success: bool
    duration_ms: int
    node_count: int
    nodes_succeeded: int
    nodes_failed: int
    description: str
    workflow_version: str | None = None
    error_message: str | None = None
    failing_node: str | None = None
    task: str | None = None
    learnings_extracted: int = 0
    created_at: datetime | None = None
    artifacts: tuple[ArtifactLink, ...] = ()
    similarity: float = 0.0
    score: float = 0.0


_TOKEN = re.compile(r"[A-Za-z0-9]+|[^\sA-Za-z0-9]")


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate that does not undercount: a word is one token per 4
    characters (at least one), any other character (punctuation, non-ASCII) is one.
    The seed's ``len(text) / 4`` undercounts non-ASCII text badly."""
    return sum(
        math.ceil(len(t) / 4) if t[0].isalnum() and t.isascii() else 1 for t in _TOKEN.findall(text)
    )


# (slice attribute, heading, which workflow outcomes: None for memories)
_SECTIONS: list[tuple[str, str, bool | None]] = [
    ("heuristics", "## Strategies that worked", None),
    ("anti_patterns", "## Mistakes to avoid", None),
    ("domain_knowledge", "## Domain knowledge", None),
    ("preferences", "## Preferences", None),
    ("outcomes", "## What happened in past runs", None),
    ("workflow_outcomes", "## Past runs that worked", True),
    ("workflow_outcomes", "## Past runs that failed", False),
]
_KINDS = list(dict.fromkeys(name for name, _, _ in _SECTIONS))


def _fact(item: Memory | WorkflowOutcome) -> str:
    """What a line says, without what varies from run to run: items of one fact make
    one line. A failure's fact is its error signature (node, error type, masked
    message), shared by its anti-pattern and each node outcome it comes from."""
    if isinstance(item, WorkflowOutcome):
        return f"run\x1f{item.id}"
    signature = item.metadata.get("error_signature")
    if signature and item.kind in (MemoryKind.ANTI_PATTERN, MemoryKind.OUTCOME):
        return f"error\x1f{signature}"
    return f"text\x1f{mask(item.content)}"


def _line(item: Memory | WorkflowOutcome) -> str:
    if isinstance(item, WorkflowOutcome):
        status = "succeeded" if item.success else "failed"
        text = (
            f"- {item.workflow_id} run {item.run_id}: {status} "
            f"({item.nodes_succeeded}/{item.node_count} nodes, {item.duration_ms} ms)"
        )
        if item.error_message:
            failing = f" at {item.failing_node}" if item.failing_node else ""
            text += f"; error{failing}: {item.error_message}"
        return text
    text = f"- {' '.join(item.content.split())}"  # one line, whatever the content holds
    if item.kind is MemoryKind.HEURISTIC:
        text += f" (confidence {item.confidence:.0%}, {item.successes}/{item.occurrences} runs)"
    elif item.kind is MemoryKind.ANTI_PATTERN:
        text += f" (seen {item.occurrences} times)"
    return text


@dataclass
class MemorySlice:
    """The memories relevant to one task, by kind, each list best first."""

    heuristics: list[Memory] = field(default_factory=list)
    anti_patterns: list[Memory] = field(default_factory=list)
    domain_knowledge: list[Memory] = field(default_factory=list)
    preferences: list[Memory] = field(default_factory=list)
    outcomes: list[Memory] = field(default_factory=list)
    workflow_outcomes: list[WorkflowOutcome] = field(default_factory=list)
    query: str | None = None
    agent: str | None = None
    scope: RetrievalScope | None = None
    plan: str | None = None  # "exact" or "approximate"
    retrieval_time_ms: float | None = None

    def items(self) -> list[Memory | WorkflowOutcome]:
        """Everything in the slice, highest score first."""
        out: list[Memory | WorkflowOutcome] = []
        for name in _KINDS:
            out.extend(getattr(self, name))
        return sorted(out, key=lambda i: -i.score)

    @property
    def empty(self) -> bool:
        return not self.items()

    def fit(
        self, max_tokens: int, count_tokens: Callable[[str], int] = estimate_tokens
    ) -> list[Memory | WorkflowOutcome]:
        """The items ``to_prompt`` keeps: best score first, across kinds, while the
        rendered prompt fits; the first that does not fit ends the selection, so what
        is kept is always the highest-scored prefix."""
        kept: list[Memory | WorkflowOutcome] = []
        for item in self.items():
            if count_tokens(self.render([*kept, item])) > max_tokens:
                break
            kept.append(item)
        return kept

    def to_prompt(
        self, max_tokens: int = 2000, count_tokens: Callable[[str], int] = estimate_tokens
    ) -> str:
        """Markdown for an agent's context, at most ``max_tokens`` by ``count_tokens``:
        the kept items (:meth:`fit`) under their kind's heading."""
        return self.render(self.fit(max_tokens, count_tokens))

    def to_doc(self, max_tokens: int = 2000) -> dict[str, Any]:
        """JSON-ready: the query, how it was searched, every item and the prompt."""
        return {
            "query": self.query,
            "scope": self.scope.value if self.scope else None,
            "plan": self.plan,
            "retrieval_time_ms": round(self.retrieval_time_ms or 0, 2),
            "items": [{"type": type(i).__name__, **_item_doc(i)} for i in self.items()],
            "prompt": self.to_prompt(max_tokens=max_tokens),
        }

    def render(self, kept: list[Memory | WorkflowOutcome]) -> str:
        """The kept items under their headings, one line per distinct fact: a fact seen
        several times is one line with its count, and a node outcome an anti-pattern
        above already states is not repeated."""
        chosen = {id(i) for i in kept}
        said: set[str] = set()
        parts = []
        for name, heading, worked in _SECTIONS:
            facts: dict[str, list[Memory | WorkflowOutcome]] = {}
            for item in getattr(self, name):
                other_outcome = isinstance(item, WorkflowOutcome) and item.success is not worked
                if id(item) not in chosen or other_outcome:
                    continue
                fact = _fact(item)
                if fact not in said:
                    facts.setdefault(fact, []).append(item)
            said.update(facts)
            lines = [
                _line(same[0]) + (f" ({len(same)} times)" if len(same) > 1 else "")
                for same in facts.values()
            ]
            if lines:
                parts.append("\n".join([heading, *lines]))
        return "\n\n".join(parts)


def _item_doc(item: Memory | WorkflowOutcome) -> dict[str, Any]:
    doc = asdict(item)
    for key in ("created_at", "updated_at"):
        if doc.get(key) is not None:
            doc[key] = doc[key].isoformat()
    if "kind" in doc:
        doc["kind"] = str(doc["kind"])
    return doc
