"""Raw record bytes in, a typed event or a typed rejection out: never an exception.

The consumers dead-letter every :class:`Rejection` with its ``reason`` and
``detail``; the reasons are stable strings (dead-letter headers and metric
labels use them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from alma_core.schemas import jsoncodec
from alma_core.schemas.events import EVENT_MODELS, Event, EventType

DEFAULT_MAX_STATE_BYTES = 1_000_000
DEFAULT_MAX_RECORD_BYTES = 8 * 1024 * 1024


class RejectReason(StrEnum):
    EMPTY = "empty"
    RECORD_TOO_LARGE = "record_too_large"
    NOT_UTF8 = "not_utf8"
    MALFORMED_JSON = "malformed_json"
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_TYPE = "unknown_type"
    SCHEMA_VIOLATION = "schema_violation"
    KEY_MISMATCH = "key_mismatch"
    STATE_TOO_LARGE = "state_too_large"
    # Not produced by the decoder: with ALMA_TENANT_TOPICS, an event that claims another
    # tenant than the topic it was written to, and a join that asks for its answer on
    # another topic than its tenant's replies (alma_core.tenancy).
    TENANT_NOT_PRODUCER = "tenant_not_producer"
    REPLY_TO_REFUSED = "reply_to_refused"
    # Not produced by the decoder: PostgreSQL refused a record the contract
    # admits (the checkpointer isolates it and dead-letters it with this reason).
    STORAGE_REJECTED = "storage_rejected"
    # Not produced by the decoder either: applying the record failed in a way that is
    # neither the server's state nor a refusal of the data (a defect); kept for replay.
    INTERNAL_ERROR = "internal_error"


@dataclass(frozen=True)
class Rejection:
    """Why a record is not an event, with what could be read of it."""

    reason: RejectReason
    detail: str
    path: str | None = None
    event_id: str | None = None
    run_id: str | None = None
    tenant_id: str | None = None

    def describe(self) -> str:
        where = f" at {self.path}" if self.path else ""
        return f"{self.reason.value}{where}: {self.detail}"


Decoded = Event | Rejection


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _unstorable(value: Any, *, nul: bool, surrogates: bool) -> str | None:
    """What PostgreSQL's jsonb cannot store, found anywhere in keys or strings: U+0000,
    and lone UTF-16 surrogates (a JSON escape that is half of a pair)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if nul and "\x00" in item:
                return "strings may not contain U+0000 (NUL); PostgreSQL cannot store it"
            if surrogates:
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return "strings may not contain lone UTF-16 surrogates (e.g. \\ud800)"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _ids(obj: dict[str, Any]) -> dict[str, str | None]:
    def pick(key: str) -> str | None:
        value = obj.get(key)
        return value[:256] if isinstance(value, str) else None

    return {"event_id": pick("event_id"), "run_id": pick("run_id"), "tenant_id": pick("tenant_id")}


def json_size(value: Any) -> int:
    """Size of a value in compact UTF-8 JSON: the unit of the state size limit."""
    return len(jsoncodec.compact(value))


def _oversized_state(event: Event, max_state_bytes: int) -> tuple[str, int] | None:
    payload = event.payload
    candidates: list[tuple[str, Any]] = []
    for name in ("state", "updates"):
        value = getattr(payload, name, None)
        if value is not None:
            candidates.append((f"payload.{name}", value))
    for i, state in enumerate(getattr(payload, "states", None) or []):
        candidates.append((f"payload.states.{i}", state))
    for path, value in candidates:
        size = json_size(value)
        if size > max_state_bytes:
            return path, size
    return None


def decode(
    raw: bytes | None,
    *,
    key: bytes | None = None,
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Decoded:
    """Decode one record value. ``key``, when given, must be the event's ``run_id``."""
    try:
        return _decode(raw, key, max_state_bytes, max_record_bytes)
    except Exception as exc:  # noqa: BLE001 - the contract: nothing escapes the decoder
        return Rejection(RejectReason.MALFORMED_JSON, f"undecodable record: {exc!r}"[:500])


def _decode(
    raw: bytes | None, key: bytes | None, max_state_bytes: int, max_record_bytes: int
) -> Decoded:
    if not raw:
        return Rejection(RejectReason.EMPTY, "the record has no value")
    if len(raw) > max_record_bytes:
        return Rejection(
            RejectReason.RECORD_TOO_LARGE,
            f"record is {len(raw)} bytes; the limit is {max_record_bytes}",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejection(RejectReason.NOT_UTF8, f"value is not UTF-8: {exc}")
    obj = jsoncodec.loads(raw)
    if obj is jsoncodec.UNSURE:  # orjson refused it, or it holds a long integer
        try:
            obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        except (ValueError, RecursionError) as exc:
            return Rejection(RejectReason.MALFORMED_JSON, f"value is not JSON: {exc}"[:500])
    if not isinstance(obj, dict):
        return Rejection(
            RejectReason.NOT_AN_OBJECT, f"value is a JSON {type(obj).__name__}, not an object"
        )
    ids = _ids(obj)
    nul, surrogates = "\\u0000" in text, _SURROGATE_ESCAPE.search(text) is not None
    if nul or surrogates:
        problem = _unstorable(obj, nul=nul, surrogates=surrogates)
        if problem:
            return Rejection(RejectReason.SCHEMA_VIOLATION, problem, **ids)
    type_ = obj.get("type")
    if not isinstance(type_, str):
        return Rejection(
            RejectReason.SCHEMA_VIOLATION, "field required: a string", path="type", **ids
        )
    try:
        event_type = EventType(type_)
    except ValueError:
        known = ", ".join(t.value for t in EventType)
        return Rejection(
            RejectReason.UNKNOWN_TYPE,
            f"unknown event type {type_[:100]!r}; known types: {known}",
            path="type",
            **ids,
        )
    try:
        event: Event = EVENT_MODELS[event_type].model_validate(obj)  # type: ignore[assignment]
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        path = ".".join(str(part) for part in first["loc"]) or None
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return Rejection(
            RejectReason.SCHEMA_VIOLATION, f"{first['msg']}{more}"[:500], path=path, **ids
        )
    except RecursionError:
        return Rejection(RejectReason.MALFORMED_JSON, "value is nested too deeply", **ids)
    if key is not None and key != event.run_id.encode():
        return Rejection(
            RejectReason.KEY_MISMATCH,
            f"record key {key[:100]!r} is not the run_id; publish with key = run_id",
            path="run_id",
            **ids,
        )
    if len(raw) > max_state_bytes:
        oversized = _oversized_state(event, max_state_bytes)
        if oversized is not None:
            path, size = oversized
            return Rejection(
                RejectReason.STATE_TOO_LARGE,
                f"state is {size} bytes; the limit is {max_state_bytes} "
                "(keep large data in artifacts)",
                path=path,
                **ids,
            )
    return event
