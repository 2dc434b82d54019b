"""The embedding model in reduced precision: bfloat16 vectors stay within the checked
tolerance of float32's on the texts ALMA embeds, retrieval finds the same nearest
texts, ``auto`` takes bfloat16 only where the CPU has it, and a model that disagrees
is refused (explicit) or kept in float32 (auto). The real model, no services."""

from __future__ import annotations

import math

import pytest

from alma_core import errors, learning
from alma_core.storage import embeddings
from alma_core.storage.embeddings import MIN_AGREEMENT, SentenceTransformerEmbedder
from bench import quality


def _description(run: quality.PastRun) -> str:
    ok = run.failed_at is None
    done = len(run.nodes) if ok else run.nodes.index(run.failed_at or "")
    finished = learning.FinishedRun(
        run.tenant, run.workflow, run.key, run.key, ok, 2500, len(run.nodes), done,
        0 if ok else 1, error_message=run.error, task=run.task,
    )  # fmt: skip
    return learning.describe(finished, None)


# What the learner embeds (the quality set's past runs, described as the learner does)
# and what retrieval asks (its questions), plus the probe texts.
DESCRIPTIONS = [_description(run) for run in quality.RUNS]
QUESTIONS = [q.text for q in quality.QUESTIONS]


@pytest.fixture(scope="module")
def float32() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder(precision="float32")


@pytest.fixture(scope="module")
def bfloat16() -> SentenceTransformerEmbedder:
    # explicit: on a CPU without native bfloat16 torch emulates it (slower, same numbers)
    return SentenceTransformerEmbedder(precision="bfloat16")


def test_bfloat16_vectors_are_unit_length_and_agree_with_float32s(
    float32: SentenceTransformerEmbedder, bfloat16: SentenceTransformerEmbedder
) -> None:
    assert (float32.precision, bfloat16.precision) == ("float32", "bfloat16")
    texts = DESCRIPTIONS + QUESTIONS + list(embeddings.PROBES)
    reference, reduced = float32.encode(texts), bfloat16.encode(texts)
    for text, a, b in zip(texts, reference, reduced, strict=True):
        assert math.isclose(math.sqrt(sum(x * x for x in b)), 1.0, abs_tol=1e-5), text
        cosine = embeddings.agreement([a], [b])
        assert cosine >= MIN_AGREEMENT, f"{text!r}: cosine {cosine:.5f} to float32's"
    assert embeddings.agreement(reference, reduced) >= bfloat16.agreement - 1e-3


def test_bfloat16_finds_the_same_nearest_past_run_for_every_question(
    float32: SentenceTransformerEmbedder, bfloat16: SentenceTransformerEmbedder
) -> None:
    def nearest(model: SentenceTransformerEmbedder) -> list[int]:
        runs, questions = model.encode(DESCRIPTIONS), model.encode(QUESTIONS)
        return [
            max(range(len(runs)), key=lambda i: sum(x * y for x, y in zip(q, runs[i], strict=True)))
            for q in questions
        ]

    assert nearest(bfloat16) == nearest(float32)


def test_float32_is_kept_bit_for_bit_by_auto_where_bfloat16_is_not_native_or_disagrees(
    float32: SentenceTransformerEmbedder,
) -> None:
    auto = SentenceTransformerEmbedder(precision="auto")
    assert auto.precision == ("bfloat16" if embeddings.native_bfloat16() else "float32")
    # no cosine reaches 1.01: auto falls back to the float32 model, unchanged
    strict = SentenceTransformerEmbedder(precision="auto", min_agreement=1.01)
    assert strict.precision == "float32"
    texts = list(embeddings.PROBES)
    assert strict.encode(texts) == float32.encode(texts)


def test_explicit_bfloat16_that_disagrees_is_a_start_up_error() -> None:
    with pytest.raises(errors.ConfigError, match="ALMA_EMBED_PRECISION=float32"):
        SentenceTransformerEmbedder(precision="bfloat16", min_agreement=1.01)


def test_agreement_is_the_worst_pair() -> None:
    same, turned = [1.0, 0.0], [0.0, 1.0]
    assert embeddings.agreement([same, same], [same, same]) == 1.0
    assert embeddings.agreement([same, same], [same, turned]) == 0.0
    with pytest.raises(ValueError, match="longer"):
        embeddings.agreement([same], [same, same])
