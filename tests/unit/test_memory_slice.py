"""MemorySlice.to_prompt: within max_tokens, keeping the highest-scored items."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from alma_core.memory import Memory, MemoryKind, MemorySlice, WorkflowOutcome, estimate_tokens
from alma_core.storage.embeddings import AsyncEmbedder

KIND_ATTR = {
    MemoryKind.HEURISTIC: "heuristics",
    MemoryKind.ANTI_PATTERN: "anti_patterns",
    MemoryKind.DOMAIN_KNOWLEDGE: "domain_knowledge",
    MemoryKind.OUTCOME: "outcomes",
}

memories = st.builds(
    lambda i, kind, text, score: Memory(f"m{i}", "t", kind, text, score=score),
    st.integers(0, 10**6),
    st.sampled_from(list(KIND_ATTR)),
    st.text(min_size=1, max_size=120),
    st.floats(min_value=0, max_value=1),
)


def slice_of(items: list[Memory], outcomes: int = 0) -> MemorySlice:
    s = MemorySlice()
    for m in sorted(items, key=lambda m: -m.score):
        getattr(s, KIND_ATTR[m.kind]).append(m)
    for i in range(outcomes):
        s.workflow_outcomes.append(
            WorkflowOutcome(
                f"o{i}",
                "t",
                "wf",
                f"r{i}",
                i % 2 == 0,
                100,
                3,
                2,
                1,
                "d",
                error_message="boom",
                failing_node="n",
                score=0.5,
            )
        )
    return s


@given(st.lists(memories, max_size=25), st.integers(0, 400), st.integers(0, 3))
def test_prompt_fits_and_keeps_the_best(items: list[Memory], budget: int, n_out: int) -> None:
    s = slice_of(items, n_out)
    kept = s.fit(budget)
    ranked = s.items()
    assert kept == ranked[: len(kept)], "the highest-scored prefix"
    assert estimate_tokens(s.to_prompt(max_tokens=budget)) <= budget
    assert s.to_prompt(max_tokens=budget) == s.render(kept)
    if len(kept) < len(ranked):  # the next one really did not fit
        assert estimate_tokens(s.render([*kept, ranked[len(kept)]])) > budget


def test_prompt_sections_and_truncation() -> None:
    s = slice_of(
        [
            Memory(
                "a",
                "t",
                MemoryKind.HEURISTIC,
                "use the cache",
                occurrences=4,
                successes=3,
                confidence=0.75,
                score=0.9,
            ),
            Memory(
                "b",
                "t",
                MemoryKind.ANTI_PATTERN,
                "never parse html with regex",
                occurrences=2,
                score=0.8,
            ),
            Memory("c", "t", MemoryKind.DOMAIN_KNOWLEDGE, "x " * 500, score=0.1),
        ],
        outcomes=1,
    )
    full = s.to_prompt(max_tokens=5000)
    assert "## Strategies that worked" in full
    assert "(confidence 75%, 3/4 runs)" in full
    assert "## Mistakes to avoid" in full
    assert "## Past runs that worked\n- wf run r0: succeeded" in full  # o0 worked

    short = s.to_prompt(max_tokens=60)
    assert "use the cache" in short
    assert "never parse" in short
    assert "x x x" not in short, "the lowest-scored, largest item is the one left out"
    assert s.to_prompt(max_tokens=0) == ""


def test_estimate_counts_non_ascii_text_fully() -> None:
    assert estimate_tokens("日本語のテキスト") == 8  # the seed's len/4 says 2
    assert estimate_tokens("hello, world") == 2 + 1 + 2


class CountingEmbedder:
    """A deterministic stand-in model for the caching logic (no I/O involved)."""

    name = "counting"
    dimension = 3

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def encode(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        return [[float(len(t)), 1.0, 0.0] for t in texts]


def test_async_embedder_batches_and_never_encodes_a_text_twice() -> None:
    model = CountingEmbedder()
    emb = AsyncEmbedder(model, batch_size=2, cache_size=10)
    sizes: list[int] = []

    async def go() -> None:
        first = await emb.embed(["a", "bb", "a", "ccc"], lambda n, s: sizes.append(n))
        assert [v[0] for v in first] == [1, 2, 1, 3]
        again = await emb.embed(["ccc", "a"])
        assert [v[0] for v in again] == [3, 1]

    asyncio.run(go())
    emb.close()
    assert model.calls == [["a", "bb"], ["ccc"]], "deduplicated, batched, then cached"
    assert sizes == [2, 1]
    assert (emb.encoded, emb.hits) == (3, 3)


@given(st.lists(st.text(min_size=1, max_size=40), max_size=30), st.integers(1, 8))
def test_async_embedder_batches_by_length_and_answers_in_order(
    texts: list[str], batch: int
) -> None:
    """Texts are encoded in batches of similar length (less padding), and each text
    still gets its own vector, in the order asked."""
    model = CountingEmbedder()
    emb = AsyncEmbedder(model, batch_size=batch, cache_size=100)
    vectors = asyncio.run(emb.embed(texts))
    emb.close()
    assert [v[0] for v in vectors] == [float(len(t)) for t in texts]
    encoded = [len(t) for call in model.calls for t in call]
    assert encoded == sorted(encoded), "one pass over the texts, shortest first"
    assert sum(len(call) for call in model.calls) == len(set(texts))


def failure(i: int, kind: MemoryKind, line: int, signature: str | None = "sig-parse") -> Memory:
    content = (
        f"In workflow wf, node parse failed with ValueError: bad tag at line {line}"
        if kind is MemoryKind.OUTCOME
        else f"Avoid: node parse of workflow wf fails with ValueError: bad tag at line {line}"
    )
    metadata = {"error_signature": signature} if signature else {}
    return Memory(f"f{i}", "t", kind, content, occurrences=3, metadata=metadata, score=0.9 - i / 10)


def test_one_line_per_fact_with_its_count() -> None:
    """Three runs failed the same way: the anti-pattern says it once, and the node
    outcomes behind it are not repeated under it."""
    said = slice_of(
        [
            failure(0, MemoryKind.ANTI_PATTERN, 3),
            *(failure(i, MemoryKind.OUTCOME, 3 + i) for i in range(1, 4)),
        ]
    ).to_prompt(max_tokens=2000)
    assert said.count("bad tag") == 1
    assert "## What happened in past runs" not in said
    alone = slice_of([failure(i, MemoryKind.OUTCOME, 3 + i) for i in range(3)]).to_prompt()
    assert alone.count("bad tag") == 1
    assert "(3 times)" in alone
    # stored before signatures were kept: the masked text is the fact
    old = slice_of([failure(i, MemoryKind.OUTCOME, 3 + i, None) for i in range(2)]).to_prompt()
    assert old.count("bad tag") == 1
    assert "(2 times)" in old


@given(st.lists(memories, max_size=25), st.integers(0, 3))
def test_a_prompt_never_repeats_a_line(items: list[Memory], n_out: int) -> None:
    doubled = [*items, *(replace(m, id=m.id + "-again") for m in items)]
    lines = [line for line in slice_of(doubled, n_out).to_prompt(5000).splitlines() if line]
    assert len(lines) == len(set(lines))
