"""JSON text the way the contract and the stored data define it, made by orjson (C,
~10× faster than the standard library here) with exactly the bytes the standard
library makes, so every hash and size stays what it was:

* ``compact(value)``: compact UTF-8 JSON (the unit of the size limits);
* ``canonical(value)``: the same with keys sorted (what ``sha256`` state hashes are
  taken of);
* ``sorted_compact(value)``: keys sorted, floats as orjson writes them (what
  ``blake3`` state hashes are taken of: no byte-for-byte guard);
* ``loads(raw)``: a record's value, or :data:`UNSURE` where orjson's reading could
  differ from the standard library's (the caller then parses with ``json``);
  ``parse(raw)`` does both.

Where orjson and ``json.dumps(..., separators=(",", ":"), ensure_ascii=False)`` differ,
and what is done about it (each case is in ``tests/unit/test_jsoncodec.py``):

* floats with 1e-10 < |x| < 1e-4: Python writes ``1e-05`` or ``2.5e-07``, orjson
  ``0.00001`` or ``2.5e-7``. Such a rendering is looked for in orjson's output (two
  searches with regular expressions; text like "e-mail" costs nothing more) and the value is
  then encoded by ``json``;
* integers beyond 64 bits: orjson refuses to write them (``json`` writes them) and
  reads them as floats (``json`` keeps them exact): writing falls back on the error,
  reading is handed to ``json`` when the record holds a run of 19 digits;
* NaN, infinities, lone surrogates, nesting deeper than 1,024, non-string keys, types
  other than JSON's: orjson refuses; ``json`` then gives the answer it always gave.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

import orjson

_OPTIONS: Final = (
    orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)  # what json.dumps refuses, orjson must not write either
_SORTED: Final = _OPTIONS | orjson.OPT_SORT_KEYS
_DIGITS_TO_ZERO: Final = bytes(
    ord("0") if chr(b).isdigit() and b < 128 else ord(" ") for b in range(256)
)
_LONG_INTEGER: Final = b"0" * 19  # past 64 bits, orjson reads a float
_TOKEN_START: Final = frozenset(b":,[-")
_EXPONENT: Final = re.compile(rb"e-[0-9](?:[,\]}]|\Z)")  # "1e-5," but not "1e-50" nor "e-mail"
_FRACTION: Final = re.compile(rb"\.0000")

UNSURE: Final = object()


def compact(value: Any) -> bytes:
    """Compact UTF-8 JSON, byte for byte ``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False).encode()``."""
    return _dumps(value, _OPTIONS, False)


def canonical(value: Any) -> bytes:
    """:func:`compact` with keys sorted: equal values, equal bytes."""
    return _dumps(value, _SORTED, True)


def sorted_compact(value: Any) -> bytes:
    """Compact UTF-8 JSON with keys sorted, as orjson writes it (floats included:
    ``0.00001`` where Python writes ``1e-05``): no search for the renderings the
    standard library writes otherwise, so ~40 % cheaper than :func:`canonical`. What
    orjson refuses is written by ``json`` as :func:`canonical` does. The text of the
    ``blake3`` state hashes."""
    try:
        return orjson.dumps(value, option=_SORTED)
    except TypeError:  # orjson.JSONEncodeError: a big integer, NaN, a surrogate, ...
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return text.encode()


def loads(raw: bytes) -> Any:
    """The JSON value of ``raw``, or :data:`UNSURE` when the standard library must read
    it (a long integer, or anything orjson refuses: the caller's ``json.loads`` then
    accepts or rejects it as it always did)."""
    if _LONG_INTEGER in raw.translate(_DIGITS_TO_ZERO):
        return UNSURE
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return UNSURE


def parse(raw: bytes) -> Any:
    """The JSON value of ``raw``, read as ``json.loads`` reads it."""
    value = loads(raw)
    return json.loads(raw) if value is UNSURE else value


def _dumps(value: Any, options: int, sort_keys: bool) -> bytes:
    try:
        out = orjson.dumps(value, option=options)
    except TypeError:  # orjson.JSONEncodeError: a big integer, NaN, a surrogate, ...
        out = None
    if out is None or _small_float(out):
        text = json.dumps(value, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False)
        return text.encode()
    return out


def _small_float(out: bytes) -> bool:
    """Whether orjson wrote a float Python writes otherwise (1e-10 < |x| < 1e-4):
    ``<digit>e-<one digit>`` ending the token, or ``0.0000`` starting one. The
    searches are regular expressions with a literal start: ``re`` skips to it ~2×
    faster than ``bytes.find`` does over text with many ``e`` or ``0``, and the token
    end is checked in C, so text full of ``e-`` (hex, UUIDs) costs no Python loop."""
    for match in _EXPONENT.finditer(out):
        i = match.start()
        if i > 0 and 48 <= out[i - 1] <= 57:
            return True
    for match in _FRACTION.finditer(out):
        i = match.start()  # at the ".": the "0" before it must start the token
        if i > 0 and out[i - 1] == 48 and (i == 1 or out[i - 2] in _TOKEN_START):
            return True
    return False
