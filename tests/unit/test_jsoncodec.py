"""schemas.jsoncodec writes and reads JSON exactly as the standard library did, so every
stored state's hash (skip-unchanged compares it), every size against the limits and
every decoded record stay what they were before orjson; the ``blake3`` hash scheme of
new runs hashes orjson's own sorted text."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from alma_core.schemas import jsoncodec
from alma_core.schemas.decoder import decode, json_size
from alma_core.sequencing import BLAKE3, SHA256, canonical_state, hash_scheme, state_hash
from alma_core.storage.cache_entries import encode_value


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
# A run's state: a few fields, each any JSON value of up to 40 leaves. With no bound on
# the fields, drawing 250 states took 18-20 s per test (10 s with this one).
states = st.dictionaries(st.text(), json_values, max_size=6)


@settings(max_examples=settings().max_examples * 5 // 3)  # 250 in the suite
@given(json_values)
def test_the_same_bytes_as_the_standard_library(value: Any) -> None:
    assert jsoncodec.compact(value) == old_compact(value)
    assert jsoncodec.canonical(value) == old_canonical(value)


@settings(max_examples=settings().max_examples * 5 // 3)  # 250 in the suite
@given(states)
def test_every_state_hashes_and_sizes_as_before(state: dict[str, Any]) -> None:
    """The ``sha256`` scheme, every run's before hash schemes: stored runs go on hashing
    byte for byte as they did."""
    before = hashlib.sha256(old_canonical(state)).hexdigest()
    assert state_hash(state, SHA256) == before
    text, digest, size = canonical_state(state, SHA256)
    assert (text.encode(), digest, size) == (old_canonical(state), before, len(text.encode()))
    assert hash_scheme(digest) == SHA256
    assert json_size(state) == len(old_compact(state))


@settings(max_examples=settings().max_examples * 5 // 3)  # 250 in the suite
@given(states)
def test_new_runs_hash_a_canonical_text_with_blake3(state: dict[str, Any]) -> None:
    """The ``blake3`` scheme (new runs): the text reads back as the same state, its keys
    in one order whatever order the state's were in, the hash is BLAKE3 of it and says
    its scheme; equal states, equal hashes, one bit of difference, another hash."""
    text, digest, size = canonical_state(state)
    assert same(json.loads(text), state)
    assert size == len(text.encode())
    assert digest == "blake3:" + blake3(text.encode()).hexdigest()
    assert hash_scheme(digest) == BLAKE3
    assert state_hash(state, BLAKE3) == digest
    reordered = dict(reversed(list(state.items())))
    assert canonical_state(reordered) == (text, digest, size)
    assert state_hash({**state, "\x00extra": 1}) != digest


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
    assert state_hash(state, SHA256) == hashlib.sha256(old_canonical(state)).hexdigest()
    text = jsoncodec.sorted_compact(state)
    assert same(json.loads(text), state)
    assert state_hash(state) == "blake3:" + blake3(text).hexdigest()


def test_the_blake3_scheme_is_pinned() -> None:
    """Stored hashes of new runs must hash the same in every later release."""
    assert state_hash({}) == (
        "blake3:6e46dd10defc9b56c29a6ec56b508c21f54c08192194e4df25bf36f0c9c3c279"
    )
    state = {"f": 1e-05, "a": [1]}  # orjson's rendering of a small float, keys sorted
    assert jsoncodec.sorted_compact(state) == b'{"a":[1],"f":0.00001}'
    assert state_hash(state) == (
        "blake3:c63915337f566ad708d4d18c60d8b6ca61edbf195ad0a7e1bede27513974d37a"
    )


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


@given(states, st.booleans())
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
