"""Text from events made safe to show and to paste (alma_core.text): a command a person
copies from the inspector or the CLI shows no control or bidirectional character, and
bash reads it back as the very id."""

from __future__ import annotations

import shutil
import subprocess

from hypothesis import given
from hypothesis import strategies as st

from alma_core.text import CONTROL, shell_word, visible

HOSTILE = ["invoice\u202egpj.exe", "a'b", "tab\there", "new\nline", "bell\x07", "c1\x85", "ok-id"]


def test_a_word_with_a_control_character_is_quoted_as_its_escape() -> None:
    assert shell_word("plain-run-1") == "plain-run-1"
    assert shell_word("two words") == "'two words'"
    assert shell_word("invoice\u202egpj.exe") == "$'invoice\\u202egpj.exe'"
    assert shell_word("it's\x07") == "$'it\\'s\\x07'"
    assert shell_word("back\\slash\n") == "$'back\\\\slash\\x0a'"
    for text in HOSTILE:
        assert not CONTROL.search(shell_word(text)), text


def test_visible_escapes_controls_but_keeps_tab_newline_and_letters() -> None:
    assert visible("invoice\u202egpj.exe") == "invoice\\u202egpj.exe"
    assert visible("plain ascii, printable") == "plain ascii, printable"
    assert visible("bell\x07 and del\x7f") == "bell\\x07 and del\\x7f"
    assert visible("tab\tand\nnewline, ünïcödé, 日本") == "tab\tand\nnewline, ünïcödé, 日本"


def _bash_reads(words: list[str]) -> list[str]:
    """What bash makes of ``printf '%s\\0' WORD...`` with each word as shell_word quotes it."""
    bash = shutil.which("bash")
    assert bash, "bash is part of the machine the tests run on"
    script = "printf '%s\\0' " + " ".join(shell_word(w) for w in words)
    done = subprocess.run(
        [bash, "-c", script], capture_output=True, check=True, env={"LC_ALL": "C.UTF-8"}
    )
    return done.stdout.decode("utf-8").split("\0")[:-1]


def test_bash_reads_every_quoted_word_back_as_it_was() -> None:
    assert _bash_reads(HOSTILE) == HOSTILE


# what an id can hold: any character but NUL and a lone surrogate (the decoder refuses
# both: PostgreSQL's text cannot hold them)
IDS = st.characters(exclude_characters="\x00", exclude_categories=("Cs",))


@given(st.lists(st.text(IDS, min_size=1), min_size=1, max_size=20))
def test_any_id_pasted_into_bash_is_that_id(words: list[str]) -> None:
    assert _bash_reads(words) == words
