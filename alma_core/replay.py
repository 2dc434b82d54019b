"""Replay to verify, in pure code: a run's recorded events folded again through today's
core (:class:`~alma_core.sequencing.Sequencer`, :func:`~alma_core.joining.merge`, the
reducers) into a scratch projection, and every checkpoint it makes compared with the
one stored at that seq (kind and state hash; for a state that differs, the first path).

What is recomputed and what is given: ``updates`` are folded again with the reducers,
joins merged again from the replayed heads (at the seq the stored merge took: the
joiner merges a join right after its position in the run), failures and completions
sequenced again. A ``state`` given in full is not in the audit log (the checkpoint
holds it): replay takes it from the checkpoint its event made, so it checks its seq
and hash, not its content. LangGraph's ``graph.*`` events make no checkpoints of these.

Replay to migrate (:func:`rebuild`): the same refold, kept when it makes the run's
checkpoints at the same seqs with the same kinds; the states that differ are what a
new projection of the run rewrites (:mod:`alma_core.storage.replays`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from alma_core import errors, history, joining
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.schemas.events import BranchJoin, Event
from alma_core.sequencing import (
    MAIN,
    Coordinates,
    Head,
    RunView,
    Sequencer,
    branch_key,
    hash_scheme,
)

_NOWHERE = Coordinates("replay", 0, 0)


@dataclass(frozen=True)
class Stored:
    """A stored checkpoint, as replay compares it."""

    seq: int
    kind: str
    state_hash: str
    state: dict[str, Any]
    event_id: str | None


@dataclass(frozen=True)
class Difference:
    """The first place where the replay and the stored run part: at ``seq``, ``what``
    (``state``, ``kind``, ``missing``: stored but not made again, ``extra``: made
    again but not stored, ``refused``: an event applied then is refused now), the path
    of the first differing value, and both sides."""

    seq: int
    what: str
    path: str | None = None
    stored: Any = None
    replayed: Any = None
    detail: str = ""

    def to_doc(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "what": self.what,
            "path": self.path,
            "stored": self.stored,
            "replayed": self.replayed,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Verdict:
    """One run's replay: how many events and checkpoints it went through, and its first
    difference (None: every checkpoint made again, the same)."""

    tenant_id: str
    run_id: str
    events: int
    checkpoints: int
    difference: Difference | None = None
    skipped: str | None = None  # why the run cannot replay (events or checkpoints pruned)

    def to_doc(self) -> dict[str, Any]:
        return {
            "tenant_id": self.tenant_id,
            "run_id": self.run_id,
            "events": self.events,
            "checkpoints": self.checkpoints,
            "difference": self.difference.to_doc() if self.difference else None,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class Refold:
    """A run's events folded again: the checkpoints made, by seq, or where an event the
    run applied is refused now (nothing after it was folded)."""

    made: dict[int, Stored]
    refused: Difference | None = None


def refold(
    run: RunView,
    events: Sequence[Event],
    stored: Mapping[int, Stored],
    *,
    config: ReducerConfig | None,
    registry: ReducerRegistry,
    max_state_bytes: int,
) -> Refold:
    """Fold ``events`` (the run's, in their order) into a fresh projection of ``run``
    (its identity; nothing of its stored progress) with ``config``; a join is merged
    again where ``stored`` has its merge."""
    fresh = RunView(run.run_id, run.tenant_id, run.workflow_id, run.workflow_version)
    if stored:  # the run's new branches hash as its stored ones did
        fresh.hash_scheme = hash_scheme(stored[min(stored)].state_hash)
    key = fresh.key
    configs = {(run.tenant_id, run.workflow_id): config} if config is not None else {}
    sequencer = Sequencer(
        runs={key: fresh},
        heads={},
        reducer_configs=configs,
        known_event_ids={},
        registry=registry,
        max_state_bytes=max_state_bytes,
    )
    merges = {cp.event_id: cp for cp in stored.values() if cp.kind == "merge"}
    made: dict[int, Stored] = {}
    for event in events:
        at = fresh.last_seq + 1
        try:
            sequencer.fold(event, _NOWHERE)
            if isinstance(event, BranchJoin) and event.event_id in merges:
                merged = _merge(sequencer, key, event, config, registry, max_state_bytes)
                made[merged.seq] = merged
        except errors.RejectedEvent as exc:
            detail = f"{event.type} {event.event_id}: {exc}"
            return Refold(made, Difference(at, "refused", detail=detail))
    for row in sequencer.effects.checkpoints:
        made[row.seq] = Stored(row.seq, row.kind, row.state_hash, row.state, row.event_id)
    return Refold(made)


def replay(
    run: RunView,
    events: Sequence[Event],
    stored: Mapping[int, Stored],
    *,
    config: ReducerConfig | None,
    registry: ReducerRegistry,
    max_state_bytes: int,
) -> Verdict:
    """Fold ``events`` again with ``config`` (:func:`refold`) and compare with ``stored``."""
    folded = refold(
        run, events, stored, config=config, registry=registry, max_state_bytes=max_state_bytes
    )
    first = folded.refused or first_difference(stored, folded.made)
    return Verdict(run.tenant_id, run.run_id, len(events), len(stored), first)


@dataclass(frozen=True)
class Rebuild:
    """What migrating a run to a new projection changes: the checkpoints (same seq, same
    kind) whose state differs, as the refold made them; or why the run cannot migrate
    (``refused``: its refold made other seqs or kinds, or refused an event)."""

    changed: list[Stored]
    refused: Difference | None = None


def rebuild(stored: Mapping[int, Stored], folded: Refold) -> Rebuild:
    """The rebuild of a run from its refold. A migration keeps every seq (the audit
    log, joins, heads and callers' ``expected_seq`` name checkpoints by seq): a refold
    that makes a checkpoint more or fewer, or of another kind, is refused with its
    first structural difference."""
    if folded.refused is not None:
        return Rebuild([], folded.refused)
    made = folded.made
    for seq in sorted(set(stored) | set(made)):
        theirs, ours = stored.get(seq), made.get(seq)
        if theirs is None or ours is None or theirs.kind != ours.kind:
            here = first_difference({seq: theirs} if theirs else {}, {seq: ours} if ours else {})
            return Rebuild([], here)
    changed = [made[s] for s in sorted(made) if made[s].state_hash != stored[s].state_hash]
    return Rebuild(changed)


def _merge(
    sequencer: Sequencer,
    key: tuple[str, str],
    event: BranchJoin,
    config: ReducerConfig | None,
    registry: ReducerRegistry,
    max_state_bytes: int,
) -> Stored:
    """The join merged again from the replayed heads, as the joiner does right after
    the join's position; the heads move as the joiner's do (the branches consumed)."""
    heads = {k[2]: h for k, h in sequencer.heads.items() if k[:2] == key}
    merged = joining.merge(
        event.payload,
        main=heads.get(MAIN),
        branches={b: h for b, h in heads.items() if b != MAIN},
        registered=config,
        registry=registry,
        max_state_bytes=max_state_bytes,
    )
    run = sequencer.runs[key]
    run.last_seq += 1
    sequencer.heads[(*key, MAIN)] = Head(run.last_seq, merged.state_hash, merged.state)
    for branch in event.payload.branch_ids or ():
        sequencer.heads.pop((*key, branch_key(branch)), None)
    return Stored(run.last_seq, "merge", merged.state_hash, merged.state, event.event_id)


def first_difference(stored: Mapping[int, Stored], made: Mapping[int, Stored]) -> Difference | None:
    """Where the replayed checkpoints first differ from the stored ones, by seq."""
    for seq in sorted(set(stored) | set(made)):
        theirs, ours = stored.get(seq), made.get(seq)
        if ours is None:
            return Difference(seq, "missing", detail="stored, but not made by the replay")
        if theirs is None:
            return Difference(seq, "extra", detail="made by the replay, but not stored")
        if theirs.kind != ours.kind:
            return Difference(seq, "kind", stored=theirs.kind, replayed=ours.kind)
        if theirs.state_hash != ours.state_hash:
            changes = history.diff(theirs.state, ours.state)
            if not changes:  # the same values, hashed otherwise (its scheme, its text)
                return Difference(
                    seq,
                    "state",
                    detail=f"the same values with another hash: stored {theirs.state_hash}, "
                    f"replayed {ours.state_hash}",
                )
            first = changes[0]
            return Difference(
                seq, "state", path=first.path, stored=first.before, replayed=first.after
            )
    return None
