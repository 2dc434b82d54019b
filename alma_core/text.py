"""Text that came in events (ids, details, values) made safe to show: on a page, in a
terminal, and in a command a person copies. Pure; unit-tested (tests/unit/test_text.py).

Shown as escapes: C0 and C1 controls (but tab and newline), DEL, the line and paragraph
separators, and the bidirectional controls (embeddings, overrides, isolates, marks):
``invoice\\u202egpj.exe`` must not read ``invoice...exe.jpg``.
"""

from __future__ import annotations

import re
import shlex

_OTHERS = "\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
CONTROL = re.compile(f"[\x00-\x08{_OTHERS}]")  # what is shown escaped: not tab, newline
_IN_A_WORD = re.compile(f"[\x00-\x0a{_OTHERS}]")  # in a command to paste: those too


def visible(text: str) -> str:
    """Control and bidirectional characters (but newline and tab) as ``\\xNN`` or
    ``\\uNNNN`` escapes."""
    if text.isascii() and text.isprintable():  # most ids and values: nothing to escape
        return text
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def shell_word(text: str) -> str:
    """``text`` as one word of a POSIX shell command that shows no control or
    bidirectional character and, pasted into bash or zsh, is ``text`` again: quoted as
    :func:`shlex.quote` does, or, with such a character in it (a tab and a newline
    included), as ``$'...'`` with the character as its ``\\xNN``/``\\uNNNN`` escape."""
    if not _IN_A_WORD.search(text):
        return shlex.quote(text)

    def escaped(ch: str) -> str:
        if ch in "\\'":
            return "\\" + ch
        if _IN_A_WORD.fullmatch(ch):
            return f"\\x{ord(ch):02x}" if ord(ch) < 0x80 else f"\\u{ord(ch):04x}"
        return ch

    return "$'" + "".join(escaped(ch) for ch in text) + "'"
