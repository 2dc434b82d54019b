"""schemas.jsoncodec writes and reads JSON exactly as the standard library did, so every
stored state's hash (skip-unchanged compares it), every size against the limits and
every decoded record stay what they were before orjson."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alma_core.sequencing import canonical_state, state_hash
from alma_core.storage.cache_entries import encode_value
from schemas import jsoncodec
from schemas.decoder import decode, json_size


def old_compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def old_canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def same(a: Any, b: Any) -> bool:
    """Equal values of the same JSON types (1 and 1.0 differ, as their text does)."""
    return old_canonical(a) == old_canonical(b)


# Floats where Python's and orjson's renderings part (1e-10 < |x| < 1e-4), around them,
# and anywhere; integers past 64 bits.
tricky_floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=1e-11, max_value=2e-4),
    st.floats(min_value=-2e-4, max_value=-1e-11),
    st.sampled_from([1e-5, 2.5e-7, 1e-10, 9.99e-11, 1e-4, 0.0001, 1e16, 1e-16, 5e-324, -0.0]),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.integers(min_value=-(2**100), max_value=2**100),
    tricky_floats,
    st.text(),
    st.sampled_from(["e-mail", "1e-5", "[0.00001]", ":0.0000", "日本語", "\u2028", "\x00\x1f\x7f"]),
)
json_values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(), children),
    max_leaves=40,
)


@settings(max_examples=settings().max_examples * 5 // 3)  # 250 in the suite
@given(json_values)
def test_the_same_bytes_as_the_standard_library(value: Any) -> None:
    assert jsoncodec.compact(value) == old_compact(value)
    assert jsoncodec.canonical(value) == old_canonical(value)


@settings(max_examples=settings().max_examples * 5 // 3)  # 250 in the suite
@given(st.dictionaries(st.text(), json_values))
def test_every_state_hashes_and_sizes_as_before(state: dict[str, Any]) -> None:
    before = hashlib.sha256(old_canonical(state)).hexdigest()
    assert state_hash(state) == before
    text, digest, size = canonical_state(state)
    assert (text.encode(), digest, size) == (old_canonical(state), before, len(text.encode()))
    assert json_size(state) == len(old_compact(state))


@settings(max_examples=settings().max_examples * 5 // 3)  # 250 in the suite
@given(json_values)
def test_reading_gives_what_json_loads_gives(value: Any) -> None:
    raw = json.dumps(value).encode()  # ASCII escapes
    assert same(jsoncodec.parse(raw), json.loads(raw))
    raw = old_compact(value)  # UTF-8 text
    fast = jsoncodec.loads(raw)
    assert fast is jsoncodec.UNSURE or same(fast, json.loads(raw))


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"": ""},
        {"a": []},
        {"f": 1e-05, "g": 2.5e-07, "h": 1e16, "i": 0.1, "j": -0.0, "k": 5e-324},
        {"big": 2**64, "neg": -(2**63) - 1, "huge": 10**30},
        {"text": 'é 日本 🙂 \u2028 \x1f \\ " /', "é": {"z": 1, "a": [1, {"b": None}]}},
        {"nested": [[[[{"x": [True, False, None, 1.5]}]]]]},
    ],
    ids=["empty", "empty-key", "empty-list", "floats", "big-integers", "non-ascii", "nested"],
)
def test_known_states_hash_as_before(state: dict[str, Any]) -> None:
    assert jsoncodec.canonical(state) == old_canonical(state)
    assert state_hash(state) == hashlib.sha256(old_canonical(state)).hexdigest()


def test_long_integers_are_read_exactly() -> None:
    raw = b'{"type":"x","n":123456789012345678901234567890,"m":18446744073709551616}'
    assert jsoncodec.loads(raw) is jsoncodec.UNSURE
    assert jsoncodec.parse(raw)["n"] == 123456789012345678901234567890
    assert jsoncodec.parse(raw)["m"] == 2**64


def test_what_json_refuses_is_still_refused() -> None:
    for raw in (b'{"a":NaN}', b'{"a":1e999}', b'{"a":-Infinity}', b"[" * 5000 + b"]" * 5000):
        assert jsoncodec.loads(raw) is jsoncodec.UNSURE
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate cannot be UTF-8, as before
        jsoncodec.compact({"a": "\ud800"})
    with pytest.raises(TypeError):  # not a JSON type: refused, as json.dumps refuses it
        jsoncodec.compact({"a": object()})


def test_decoder_rejections_are_unchanged() -> None:
    """Records orjson refuses reach the standard library's reading and its reasons."""
    for raw, reason in (
        (b'{"type":"node.completed","x":NaN}', "malformed_json"),
        (b'{"type":"node.completed","x":1e999}', "malformed_json"),
        (b'{"type": 1', "malformed_json"),
        (b"[1]", "not_an_object"),
    ):
        result = decode(raw)
        assert getattr(result, "reason", None) == reason, (raw, result)


@given(st.dictionaries(st.text(), json_values), st.booleans())
def test_a_cached_value_with_the_state_spliced_in_reads_as_the_document(
    state: dict[str, Any], others: bool
) -> None:
    """The checkpointer splices its canonical state text into the cached document
    instead of encoding the state again: the value reads back as the same document."""
    doc: dict[str, Any] = (
        {"run_id": "r", "seq": 3, "metadata": {"k": [1.5, None]}} if others else {}
    )
    doc["state"] = state
    text, _, _ = canonical_state(state)
    spliced = encode_value(3, doc, text)
    plain = encode_value(3, doc)
    assert spliced.startswith("3:")
    assert plain.startswith("3:")
    assert same(json.loads(spliced[2:]), json.loads(plain[2:]))
    assert same(json.loads(spliced[2:]), doc)
