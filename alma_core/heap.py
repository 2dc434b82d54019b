"""The process's heap and Python's cyclic garbage collector: what a long-running
command (a worker, `alma up`, `alma ui`) does once it has started."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("alma.worker")


def freeze_heap() -> int:
    """Put everything alive after start-up (modules, pools, clients and, with the
    learner, the embedding model) out of the cyclic garbage collector's sight, so a
    full collection walks only what was made since, not the start-up objects while the
    event loop (every consumer) stands still (docs/metrics.md, ``alma_gc_pause_seconds``,
    has the figures). Garbage is collected first, so none is kept: that collection is
    the last full walk of the start-up objects, one such pause at start. Process-wide:
    the CLI's long-running commands call it once their workers are ready, the
    inspector once it is built (``ALMA_GC_FREEZE``); a library never should. What was
    frozen and dies later in a reference cycle is not reclaimed: start-up objects live
    as long as the process.
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "start-up objects frozen out of the garbage collector's sight",
        extra={"action": "heap_frozen", "objects": frozen},
    )
    return frozen
