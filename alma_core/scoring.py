"""How retrieval ranks what it found. Pure functions.

**Relevance first** (``ranking="relevance"``, the default): the score is the
similarity, plus at most ``tie_band`` from recency and confidence (weighted as
``recency`` and ``confidence`` say), over ``1 + tie_band``. Items more than
``tie_band`` apart in similarity keep their similarity order; closer ones are
ordered by recency and confidence. Success rate is no part of the score: a failure
that answers the question is what the next run needs most, and whether an item
worked decides the section it is shown in (``MemorySlice``), never whether it is
shown. Measured on a labelled set (``bench.quality``), this ranks the right past run
first as often as cosine similarity alone, where the seed's weighted sum buried
failures under any success.

**Weighted** (``ranking="weighted"``): the architecture seed's weighted sum of
similarity, recency, success rate and confidence (0.4, 0.3, 0.2, 0.1), kept as a
setting. Recency halves every ``half_life_days`` (30) in both.

Success rate and confidence mean something only for some kinds: a heuristic has
its successes over occurrences and its stored confidence; a workflow outcome
succeeded (1) or not (0) and is an observed fact (confidence 1). For
anti-patterns, knowledge, preferences and node outcomes, success rate is
neutral (0.5) so a failure record is not ranked down for being one; their
confidence is the stored one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alma_core.memory import MemoryKind

NEUTRAL = 0.5


class ScoringWeights(BaseModel):
    """Weights of the four signals (they need not sum to 1) and the recency half-life."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ranking: Literal["relevance", "weighted"] = "relevance"
    tie_band: float = Field(default=0.05, ge=0, le=1)
    similarity: float = Field(default=0.4, ge=0)
    recency: float = Field(default=0.3, ge=0)
    success_rate: float = Field(default=0.2, ge=0)
    confidence: float = Field(default=0.1, ge=0)
    half_life_days: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _some_weight(self) -> ScoringWeights:
        if self.similarity + self.recency + self.success_rate + self.confidence <= 0:
            raise ValueError("at least one weight must be positive")
        return self


@dataclass(frozen=True)
class Signals:
    similarity: float
    age_days: float
    success_rate: float
    confidence: float


def similarity_from_distance(cosine_distance: float) -> float:
    """pgvector's cosine distance (0 = same direction, 2 = opposite) as 0..1."""
    return min(1.0, max(0.0, 1.0 - cosine_distance))


def recency(age_days: float, half_life_days: float) -> float:
    """``0.5 ** (age / half_life)``: 1 now, 0.5 after one half-life; the future counts as now."""
    return float(0.5 ** (max(0.0, age_days) / half_life_days))


def score(signals: Signals, weights: ScoringWeights) -> float:
    """Within 0..1: relevance first (similarity, ties by recency and confidence), or the
    seed's weighted sum divided by the weights' total."""
    if weights.ranking == "relevance":
        return _relevance(signals, weights)
    total = weights.similarity + weights.recency + weights.success_rate + weights.confidence
    raw = (
        weights.similarity * signals.similarity
        + weights.recency * recency(signals.age_days, weights.half_life_days)
        + weights.success_rate * signals.success_rate
        + weights.confidence * signals.confidence
    )
    return raw / total


def _relevance(signals: Signals, weights: ScoringWeights) -> float:
    fresh = recency(signals.age_days, weights.half_life_days)
    tie_weights = weights.recency + weights.confidence
    tie = (
        (weights.recency * fresh + weights.confidence * signals.confidence) / tie_weights
        if tie_weights > 0
        else 0.0
    )
    return (signals.similarity + weights.tie_band * tie) / (1 + weights.tie_band)


def _age_days(when: datetime | None, now: datetime) -> float:
    return 0.0 if when is None else (now - when).total_seconds() / 86400.0


def kind_signals(
    kind: str,
    occurrences: int,
    successes: int,
    confidence: float,
    updated: datetime | None,
    distance: float,
    now: datetime,
) -> Signals:
    """A memory's signals from its fields (retrieval ranks rows before it builds the
    items it keeps)."""
    if kind == MemoryKind.HEURISTIC and occurrences > 0:
        success = successes / occurrences
    else:
        success = NEUTRAL
    return Signals(
        similarity=similarity_from_distance(distance),
        age_days=_age_days(updated, now),
        success_rate=success,
        confidence=min(1.0, max(0.0, confidence)),
    )


def run_signals(success: bool, created: datetime | None, distance: float, now: datetime) -> Signals:
    """A workflow outcome's signals from its fields."""
    return Signals(
        similarity=similarity_from_distance(distance),
        age_days=_age_days(created, now),
        success_rate=1.0 if success else 0.0,
        confidence=1.0,
    )
