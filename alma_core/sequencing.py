"""Folding a partition's events into checkpoints: the pure centre of the checkpointer.

The storage adapter loads what the batch needs (runs, branch heads, reducer
configurations, the event ids already recorded) into a :class:`Sequencer`,
feeds it the batch's events in partition order, and writes the effects it
returns in one transaction. No I/O here, so every rule is unit-tested:

* seq is the run's next number (gapless: the counter lives in the run row);
* ``updates`` fold into the head of the event's branch (the main line when
  ``branch_id`` is null) with the run's reducers; a branch starts empty and
  holds what the branch wrote;
* a state equal (by hash) to its branch head records the event, no checkpoint;
* a run is ``(tenant_id, run_id)``: two tenants' runs of one id are two runs;
* a stale ``expected_seq``, an unknown reducer, a state over the limit (the tenant's
  own where it has a lower one: ``state_limits``):
  :class:`errors.RejectedEvent`, nothing changes;
* an ``event_id`` the tenant used before, for the same run, has no effect at all; one
  another run of the tenant used is :class:`errors.EventIdReused` (dropping it would
  lose the event);
* a completed run (its first ``workflow.completed`` applied) takes no more node events
  or joins (:class:`errors.RunCompleted`): work sent after the end, or a script run
  again with the same run id, would otherwise fold into a finished run's state; a later
  ``workflow.completed`` is recorded without effect (the first outcome stands); an
  event applied before the completion and delivered again is still a duplicate;
* a closed run that retention pruned takes no more events (:class:`errors.RunPruned`):
  its inbox may be gone, so a replayed event could otherwise take effect again;
* a new run of a tenant at its storage quota (``over_quota``) is refused
  (:class:`errors.StorageQuotaExceeded`): its run row is kept, marked ``refused`` (the
  one change a refused event makes), so that its later events are refused too, whatever
  the quota by then, until a replay of its dead letters reopens it; the runs begun
  before go on;
* a LangGraph thread's events (``graph.*``) are recorded in order and handed to the
  store as they are (:mod:`alma_core.storage.graphs` writes their rows).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal

from blake3 import blake3

from alma_core import errors
from alma_core.reducers import ReducerConfig, ReducerRegistry, apply_updates
from alma_core.schemas import jsoncodec
from alma_core.schemas.events import (
    GRAPH_EVENTS,
    BranchJoin,
    Event,
    GraphUpkeep,
    NodeCompleted,
    NodeFailed,
    NodeStarted,
    WorkflowCompleted,
)

MAIN = ""  # branch key of the main line
REFUSED = "refused"  # a run refused at its start (storage quota): it holds nothing
# every status a run's row holds (the runs table's CHECK): on its way, ended, or refused
RUN_STATUSES: Final = ("running", "succeeded", "failed", REFUSED)
# a running run one of whose events waits in the dead letters (docs/guarantees.md §11):
# a status shown (lists, counts, pages), derived from the letters, never a row's
BLOCKED = "blocked"
SHOWN_STATUSES: Final = ("running", BLOCKED, "succeeded", "failed", REFUSED)
# what a completed run refuses (errors.RunCompleted); LangGraph's graph.* go on
AFTER_THE_END = (NodeStarted, NodeCompleted, NodeFailed, BranchJoin)

RunKey = tuple[str, str]  # (tenant_id, run_id): a run's identity


def refused_now(
    event: Event, *, status: str | None, completed: bool, last_seq: int
) -> errors.RejectedEvent | None:
    """What the sequencer would refuse ``event`` for, its run standing as given
    (``status`` None: no such run yet): the run's end, or an ``expected_seq`` the run
    has moved past. The rules :meth:`Sequencer.apply` applies, for a dead letter about
    to be sent back (``alma dlq replay``, the inspector), which would else return to the
    dead letters at once."""
    if status is None:
        return None
    if completed and isinstance(event, AFTER_THE_END):
        return errors.RunCompleted(
            f"run {event.run_id!r} is completed ({status}): it takes no {event.type} any more"
        )
    if isinstance(event, NodeCompleted):
        expected = event.payload.expected_seq
        if expected is not None and expected != last_seq:
            return errors.StaleExpectedSeq(
                f"run {event.run_id!r} is at seq {last_seq}, the event expects {expected}"
            )
    return None


HeadKey = tuple[str, str, str]  # (tenant_id, run_id, branch key)

Effect = Literal["checkpointed", "unchanged", "recorded", "handed_off"]


def state_limit(limits: Mapping[str, int], tenant_id: str, default: int) -> tuple[int, str]:
    """``tenant_id``'s state size limit, its own where ``limits`` has one (below the
    global ``default``), and how a refusal names it."""
    own = limits.get(tenant_id)
    if own is None:
        return default, f"the limit is {default} (keep large data in artifacts)"
    return own, (
        f"the tenant's own limit is {own} (alma tenants set --max-state-bytes; keep large "
        "data in artifacts)"
    )


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys (:func:`alma_core.schemas.jsoncodec.canonical`)."""
    return jsoncodec.canonical(value).decode()


# State hashes, in two schemes. A hash says its scheme: ``blake3:<64 hex>`` (BLAKE3 of
# orjson's sorted compact JSON, the scheme of new runs) or bare ``<64 hex>`` (SHA-256 of
# the standard library's canonical JSON: every hash stored before schemes). A state is
# compared with its head in the head's scheme, and a run's new branches take the run's
# scheme, so stored runs go on hashing as they did: skip-unchanged, replay and joins
# compare like with like, and no stored hash is rewritten.
BLAKE3: Final = "blake3"
SHA256: Final = "sha256"
HASH_SCHEME: Final = BLAKE3  # new runs
_BLAKE3_PREFIX: Final = "blake3:"


def hash_scheme(digest: str) -> str:
    """The scheme a stored state hash was made with."""
    return BLAKE3 if digest.startswith(_BLAKE3_PREFIX) else SHA256


def short_hash(digest: str, hex_digits: int = 12) -> str:
    """A hash to show: its scheme's prefix (if any) and its first ``hex_digits``."""
    prefix, _, hex_part = digest.rpartition(":")
    return f"{prefix}:{hex_part[:hex_digits]}" if prefix else hex_part[:hex_digits]


def canonical_state(state: dict[str, Any], scheme: str = HASH_SCHEME) -> tuple[str, str, int]:
    """The state's JSON text, its hash in ``scheme`` and the text's size in bytes, from
    one encoding."""
    if scheme == SHA256:
        raw = jsoncodec.canonical(state)
        return raw.decode(), hashlib.sha256(raw).hexdigest(), len(raw)
    raw = jsoncodec.sorted_compact(state)
    return raw.decode(), _BLAKE3_PREFIX + blake3(raw).hexdigest(), len(raw)


def state_hash(state: dict[str, Any], scheme: str = HASH_SCHEME) -> str:
    """The state's hash in ``scheme``: equal states, equal hashes."""
    return canonical_state(state, scheme)[1]


def branch_key(branch_id: str | None) -> str:
    return branch_id or MAIN


@dataclass
class RunView:
    run_id: str
    tenant_id: str
    workflow_id: str
    workflow_version: str | None
    status: str = "running"
    last_seq: int = 0
    event_count: int = 0
    completed_at: datetime | None = None
    pruned: bool = False  # retention began on this closed run: it takes no more events
    released: bool = False  # its LangGraph thread was deleted: another graph may take it
    changed: bool = False
    hash_scheme: str = HASH_SCHEME  # of its new branches: its heads' (not stored)

    @property
    def key(self) -> RunKey:
        return (self.tenant_id, self.run_id)


@dataclass(frozen=True)
class Head:
    seq: int
    state_hash: str
    state: dict[str, Any]


@dataclass(frozen=True)
class CheckpointRow:
    run_id: str
    seq: int
    tenant_id: str
    kind: str
    node_id: str | None
    branch_id: str | None
    parent_seq: int | None
    event_id: str
    state: dict[str, Any]
    state_json: str
    state_hash: str
    size_bytes: int
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Coordinates:
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class EventRow:
    event: Event
    effect: Effect
    checkpoint_seq: int | None
    coords: Coordinates
    run_seq: int = 0  # the run's latest seq once this event is applied (its position)


@dataclass
class Effects:
    """Everything one batch changes, in the order it happened."""

    checkpoints: list[CheckpointRow] = field(default_factory=list)
    events: list[EventRow] = field(default_factory=list)
    handoffs: list[EventRow] = field(default_factory=list)
    graph: list[EventRow] = field(default_factory=list)  # LangGraph threads' rows to write
    duplicates: int = 0


class Sequencer:
    """Applies events in order to the runs loaded for a batch; collects the effects."""

    def __init__(
        self,
        *,
        runs: dict[RunKey, RunView],
        heads: dict[HeadKey, Head],
        reducer_configs: dict[tuple[str, str], ReducerConfig],
        known_event_ids: dict[tuple[str, str], str],
        registry: ReducerRegistry,
        max_state_bytes: int,
        over_quota: frozenset[str] = frozenset(),
        state_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.runs = runs
        self.over_quota = over_quota  # tenants at their storage quota: no new runs
        self.state_limits = state_limits or {}  # tenants' own limits, below the global
        self.heads = heads
        self.reducer_configs = reducer_configs
        self.seen = dict(known_event_ids)  # (tenant_id, event_id) -> the run it belongs to
        self.registry = registry
        self.max_state_bytes = max_state_bytes
        self.effects = Effects()
        self.touched_heads: dict[HeadKey, Head] = {}
        for (tenant_id, run_id, _), head in heads.items():
            run = runs.get((tenant_id, run_id))
            if run is not None:  # a stored run keeps its scheme on its new branches
                run.hash_scheme = hash_scheme(head.state_hash)

    # -- public ---------------------------------------------------------------

    def fold(self, event: Event, coords: Coordinates) -> Effect | None:
        """Apply one event. Returns its effect, or None for a duplicate.

        Raises :class:`errors.RejectedEvent` (and changes nothing, but for a run
        refused at its start: marked ``refused``) when the event cannot be applied.
        """
        owner = self.seen.get((event.tenant_id, event.event_id))
        if owner is not None:
            if owner != event.run_id:
                raise errors.EventIdReused(
                    f"event_id {event.event_id!r} belongs to run {owner!r} of this tenant; "
                    "give each event of each run its own id"
                )
            self.effects.duplicates += 1
            return None
        run = self._run_for(event)
        if run.completed_at is not None and isinstance(event, AFTER_THE_END):
            raise errors.RunCompleted(
                f"run {event.run_id!r} was completed at {run.completed_at.isoformat()} "
                f"({run.status}): it takes no {event.type} any more; give new work a new run id"
            )
        if isinstance(event, NodeCompleted):
            effect, seq = self._node_completed(run, event)
        elif isinstance(event, NodeFailed):
            effect, seq = self._node_failed(run, event)
        elif isinstance(event, (NodeStarted, *GRAPH_EVENTS)):
            effect, seq = "recorded", None
        elif isinstance(event, WorkflowCompleted) and run.completed_at is not None:
            effect, seq = "recorded", None  # the first outcome stands
        elif isinstance(event, BranchJoin | WorkflowCompleted):
            effect, seq = "handed_off", None
            if isinstance(event, WorkflowCompleted):
                run.status = "succeeded" if event.payload.outcome == "success" else "failed"
                run.completed_at = event.emitted_at
        else:  # pragma: no cover - the union is closed
            raise errors.RejectedEvent(f"unhandled event type {type(event).__name__}")
        if run.key not in self.runs:
            self.runs[run.key] = run
        run.released = isinstance(event, GraphUpkeep) and event.payload.deletes_thread
        run.event_count += 1
        run.changed = True
        self.seen[(event.tenant_id, event.event_id)] = event.run_id
        row = EventRow(event, effect, seq, coords, run.last_seq)
        self.effects.events.append(row)
        if effect == "handed_off":
            self.effects.handoffs.append(row)
        elif isinstance(event, GRAPH_EVENTS):
            self.effects.graph.append(row)
        return effect

    # -- rules ----------------------------------------------------------------

    def _run_for(self, event: Event) -> RunView:
        run = self.runs.get((event.tenant_id, event.run_id))
        if run is None:
            run = RunView(
                run_id=event.run_id,
                tenant_id=event.tenant_id,
                workflow_id=event.workflow_id,
                workflow_version=event.workflow_version,
            )
            if event.tenant_id not in self.over_quota:
                return run
            run.status, run.changed = REFUSED, True
            self.runs[run.key] = run
            raise errors.StorageQuotaExceeded(
                f"tenant {event.tenant_id!r} keeps as many checkpoint bytes as its storage "
                f"quota allows: run {event.run_id!r} is refused, its events kept in the dead "
                f"letters. What to do: raise the quota (alma tenants set {event.tenant_id} "
                "--storage-quota-bytes N) or let retention free room, then replay them in "
                f"order (alma dlq replay --run {event.run_id} --tenant {event.tenant_id})"
            )
        if run.status == REFUSED:
            raise errors.StorageQuotaExceeded(
                f"run {event.run_id!r} was refused at its start (its tenant was at its "
                "storage quota): its events wait in the dead letters. What to do: once there "
                f"is room, replay them in order (alma dlq replay --run {event.run_id} "
                f"--tenant {event.tenant_id}), which reopens the run"
            )
        if run.pruned:
            raise errors.RunPruned(
                f"run {event.run_id!r} was completed at {run.completed_at} and retention has "
                "pruned it (ALMA_*_RETENTION_DAYS): it takes no more events; give new work "
                "a new run id"
            )
        taken = run.released and isinstance(event, GRAPH_EVENTS)
        if run.workflow_id != event.workflow_id and taken:
            # a deleted thread's id is free: this graph takes the run over, as new
            run.workflow_id, run.workflow_version = event.workflow_id, event.workflow_version
            run.status, run.completed_at = "running", None
        if run.workflow_id != event.workflow_id:
            raise errors.RejectedEvent(
                f"run {event.run_id!r} belongs to workflow {run.workflow_id!r}, "
                f"not {event.workflow_id!r}"
            )
        return run

    @staticmethod
    def _scheme(run: RunView, head: Head | None) -> str:
        """The hash scheme of a state on ``head``'s branch: the head's, else the run's."""
        return hash_scheme(head.state_hash) if head is not None else run.hash_scheme

    def _config(self, run: RunView) -> ReducerConfig:
        return self.reducer_configs.get((run.tenant_id, run.workflow_id), ReducerConfig())

    def _next_state(
        self, run: RunView, key: str, state: dict[str, Any] | None, updates: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        if state is not None:
            return state
        if updates is None:
            return None
        head = self.heads.get((*run.key, key))
        return apply_updates(head.state if head else {}, updates, self._config(run), self.registry)

    def _node_completed(self, run: RunView, event: NodeCompleted) -> tuple[Effect, int | None]:
        payload = event.payload
        expected = payload.expected_seq
        if expected is not None and expected != run.last_seq:
            raise errors.StaleExpectedSeq(
                f"run {run.run_id!r} is at seq {run.last_seq}, the event expected {expected}"
            )
        key = branch_key(event.branch_id)
        new_state = self._next_state(run, key, payload.state, payload.updates)
        assert new_state is not None  # the contract requires state or updates
        head = self.heads.get((*run.key, key))
        state_json, digest, size = canonical_state(new_state, self._scheme(run, head))
        if head is not None and head.state_hash == digest:
            effect: Effect = "unchanged"
            seq = head.seq
        else:
            seq = self._checkpoint(
                run,
                event,
                key,
                new_state,
                (state_json, digest, size),
                "node",
                payload.metadata or {},
            )
            effect = "checkpointed"
        if run.status == "failed" and run.completed_at is None:
            run.status = "running"  # a retry succeeded after a node failure
        return effect, seq

    def _node_failed(self, run: RunView, event: NodeFailed) -> tuple[Effect, int | None]:
        payload = event.payload
        key = branch_key(event.branch_id)
        new_state = self._next_state(run, key, payload.state, payload.updates)
        head = self.heads.get((*run.key, key))
        if new_state is None:
            new_state = head.state if head else {}
        encoded = canonical_state(new_state, self._scheme(run, head))
        metadata: dict[str, Any] = {"error": payload.error.model_dump()}
        if payload.attempt is not None:
            metadata["attempt"] = payload.attempt
        seq = self._checkpoint(run, event, key, new_state, encoded, "failure", metadata)
        if run.completed_at is None:
            run.status = "failed"
        return "checkpointed", seq

    def _checkpoint(
        self,
        run: RunView,
        event: NodeCompleted | NodeFailed,
        key: str,
        state: dict[str, Any],
        encoded: tuple[str, str, int],
        kind: str,
        metadata: dict[str, Any],
    ) -> int:
        state_json, digest, size = encoded
        limit, says = state_limit(self.state_limits, run.tenant_id, self.max_state_bytes)
        if size > limit:
            raise errors.StateTooLarge(f"the resulting state is {size} bytes; {says}")
        parent = self.heads.get((*run.key, key)) or self.heads.get((*run.key, MAIN))
        run.last_seq += 1
        row = CheckpointRow(
            run_id=run.run_id,
            seq=run.last_seq,
            tenant_id=run.tenant_id,
            kind=kind,
            node_id=event.node_id,
            branch_id=event.branch_id,
            parent_seq=parent.seq if parent else None,
            event_id=event.event_id,
            state=state,
            state_json=state_json,
            state_hash=digest,
            size_bytes=size,
            metadata=metadata,
        )
        self.effects.checkpoints.append(row)
        head = Head(row.seq, digest, state)
        self.heads[(*run.key, key)] = head
        self.touched_heads[(*run.key, key)] = head
        return row.seq
