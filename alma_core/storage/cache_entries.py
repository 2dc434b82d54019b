"""What the checkpoint cache holds, as values: each run's hash has one field per branch
head (``@`` for the main line, ``b:<branch_id>`` for branches), ``latest`` and
``complete``; a value is ``<seq>:<json>`` (:mod:`alma_core.storage.cache` has the
layout and the scripts that write it). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from alma_core.schemas import jsoncodec
from alma_core.types import Checkpoint

MAIN_FIELD = "@"
LATEST_FIELD = "latest"
COMPLETE_FIELD = "complete"


def field_for(branch_id: str | None) -> str:
    return MAIN_FIELD if branch_id is None else f"b:{branch_id}"


@dataclass(frozen=True)
class CacheEntry:
    """One cached checkpoint (a JSON object with at least run_id, tenant_id, seq).
    ``state_json``: the document's ``state`` already as JSON text (the checkpointer's
    canonical state), spliced in rather than encoded again. ``encoded``: the stored
    value, ``<seq>:<json>``, made once (a head and ``latest`` share it)."""

    tenant_id: str
    run_id: str
    field: str
    seq: int
    document: dict[str, Any]
    state_json: str | None = None
    encoded: str = ""

    def __post_init__(self) -> None:
        if not self.encoded:
            object.__setattr__(
                self, "encoded", encode_value(self.seq, self.document, self.state_json)
            )

    def encode(self) -> str:
        return self.encoded


def encode_value(seq: int, document: Mapping[str, Any], state_json: str | None = None) -> str:
    """A cached value: ``<seq>:<document as compact JSON>``, the state spliced in when
    given as text (the same JSON value, its keys in canonical order)."""
    if state_json is None or "state" not in document:
        return f"{seq}:{jsoncodec.compact(document).decode()}"
    rest = jsoncodec.compact({k: v for k, v in document.items() if k != "state"}).decode()
    head = rest[:-1] + "," if rest != "{}" else "{"
    return f'{seq}:{head}"state":{state_json}}}'


def checkpoint_to_doc(cp: Checkpoint) -> dict[str, Any]:
    return {
        "run_id": cp.run_id,
        "tenant_id": cp.tenant_id,
        "seq": cp.seq,
        "kind": cp.kind,
        "node_id": cp.node_id,
        "branch_id": cp.branch_id,
        "parent_seq": cp.parent_seq,
        "event_id": cp.event_id,
        "state": cp.state,
        "state_hash": cp.state_hash,
        "size_bytes": cp.size_bytes,
        "merged_from": list(cp.merged_from),
        "metadata": cp.metadata,
        "created_at": cp.created_at.isoformat() if cp.created_at else None,
    }


def checkpoint_from_doc(doc: Mapping[str, Any]) -> Checkpoint:
    """A checkpoint from a database row or a cached document (``created_at`` a
    datetime or an ISO string)."""
    created = doc.get("created_at")
    return Checkpoint(
        run_id=doc["run_id"],
        tenant_id=doc["tenant_id"],
        seq=doc["seq"],
        state=doc["state"],
        state_hash=doc["state_hash"],
        size_bytes=doc["size_bytes"],
        kind=doc.get("kind") or "node",
        node_id=doc.get("node_id"),
        branch_id=doc.get("branch_id"),
        parent_seq=doc.get("parent_seq"),
        event_id=doc.get("event_id"),
        merged_from=tuple(doc.get("merged_from") or ()),
        metadata=doc.get("metadata") or {},
        created_at=datetime.fromisoformat(created) if isinstance(created, str) else created,
    )


def cache_entries(
    heads: Mapping[str | None, Checkpoint], state_json: Mapping[str | None, str] | None = None
) -> list[CacheEntry]:
    """Entries for a set of branch heads, plus the run's ``latest`` (the newest head's
    value, encoded once). ``state_json``: heads' states already as JSON, by branch."""
    texts = state_json or {}
    entries = [
        CacheEntry(
            cp.tenant_id,
            cp.run_id,
            field_for(branch),
            cp.seq,
            checkpoint_to_doc(cp),
            texts.get(branch),
        )
        for branch, cp in heads.items()
    ]
    if entries:
        newest = max(entries, key=lambda e: e.seq)
        entries.append(
            CacheEntry(
                newest.tenant_id,
                newest.run_id,
                LATEST_FIELD,
                newest.seq,
                newest.document,
                newest.state_json,
                newest.encoded,
            )
        )
    return entries


def consumed_entries(merge: Checkpoint, branches: Iterable[str]) -> list[CacheEntry]:
    """Tombstones for the branches a join consumed, at the merge's seq: a reader sees
    no head for them (a branch written again later has a higher seq and replaces it)."""
    doc = {"run_id": merge.run_id, "tenant_id": merge.tenant_id, "seq": merge.seq, "consumed": True}
    return [
        CacheEntry(merge.tenant_id, merge.run_id, field_for(b), merge.seq, doc) for b in branches
    ]


def decode_value(value: bytes | str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    raw = value if isinstance(value, bytes) else value.encode()
    _, _, body = raw.partition(b":")
    doc: dict[str, Any] = jsoncodec.parse(body)
    return doc
