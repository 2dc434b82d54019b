"""The run inspector's pure parts: a run's timeline laid out by branch, values and raw
bytes cut and made visible (the templates escape them), the list's paging cursor."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from alma_core.ui import views

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


def cp(seq: int, kind: str = "node", branch: str | None = None, **kw: object) -> dict[str, object]:
    return {
        "seq": seq,
        "kind": kind,
        "node_id": kw.pop("node", f"n{seq}"),
        "branch_id": branch,
        "size_bytes": 10,
        "created_at": T0 + timedelta(seconds=seq),
        **kw,
    }


def test_a_runs_timeline_has_a_lane_per_branch_and_places_the_rest_by_time() -> None:
    checkpoints = [
        cp(1),
        cp(2, branch="A"),
        cp(3, branch="B"),
        cp(4, "failure", branch="B", attempt=1, error_type="Timeout", error_message="slow"),
        cp(5, "merge", merged_from=[2, 4], node=None),
    ]
    joins = [{"join_id": "j0", "status": "error", "created_at": T0 + timedelta(seconds=4.5)}]
    letters = [{"reason": "stale_expected_seq", "detail": "run is at 5", "created_at": T0}]
    done = {"at": T0 + timedelta(seconds=9), "outcome": "succeeded"}
    laid = views.timeline(checkpoints, joins, letters, done, link="/c?seq={seq}")
    assert laid.lanes == ["main", "A", "B", "joins", "dead letters", "end"]
    order = [(item.kind, item.seq, column) for item, column in laid.rows()]
    assert order == [
        ("dead_letter", None, 4),  # before everything: it came first
        ("node", 1, 0),
        ("node", 2, 1),
        ("node", 3, 2),
        ("failure", 4, 2),
        ("refused_join", None, 3),
        ("merge", 5, 0),
        ("completed", None, 5),
    ]
    failure = laid.items[4]
    assert (failure.title, failure.detail) == ("n4 failed (attempt 1)", "Timeout: slow")
    assert laid.items[6].title == "merge of #2, #4"
    assert laid.items[1].link == "/c?seq=1"


def test_values_and_bytes_are_cut_and_their_control_characters_shown() -> None:
    shown = views.shown_json({"html": "<script>x</script>", "nul": "a\x00b"})
    assert "<script>x</script>" in shown.text  # escaped by the template, not here
    assert "\\u0000" in shown.text
    assert "\x00" not in shown.text
    big = views.shown_json({"s": "x" * 50_000}, limit=1000)
    assert len(big.text) == 1000
    assert big.cut == big.total - 1000
    raw = views.shown_bytes(b"\x00\xff<b>\x1b[31m\n", limit=100)
    assert raw.text == "\\x00\\xff<b>\\x1b[31m\n"
    assert views.shown_bytes(None).text == ""


def test_the_cursor_round_trips_in_every_order_and_a_foreign_one_is_the_first_page() -> None:
    token = views.cursor((T0, "run|with|bars"))
    assert views.parse_cursor(token) == (T0, "run|with|bars")
    assert views.parse_cursor("garbage") is None
    assert views.parse_cursor("not-a-time|r") is None
    assert views.parse_cursor(None) is None
    for sort, key in (("duration", 1234.5678901234), ("status", 5)):
        token = views.cursor((key, T0, "run|with|bars"))
        assert views.parse_cursor(token, sort) == (key, T0, "run|with|bars")
        assert views.parse_cursor(views.cursor((T0, "r")), sort) is None  # another order's
    assert views.parse_cursor("x|" + T0.isoformat() + "|r", "duration") is None


def test_control_and_bidirectional_characters_are_shown_as_escapes() -> None:
    """`invoice\\u202egpj.exe` must not read `invoice…exe.jpg`: every control, separator
    and bidirectional character is an escape wherever event text is shown."""
    hostile = "invoice\u202egpj.exe"
    assert views.visible(hostile) == "invoice\\u202egpj.exe"
    for char in ("\u202a", "\u202b", "\u202c", "\u202d", "\u2066", "\u2067", "\u2068", "\u2069"):
        assert char not in views.visible(f"a{char}b")
    for char in ("\u200e", "\u200f", "\u061c", "\u2028", "\u2029", "\x00", "\x1b", "\x85"):
        assert char not in views.visible(f"a{char}b")
    assert views.visible("tab\tand\nnewline, ünïcödé, 日本") == "tab\tand\nnewline, ünïcödé, 日本"
    assert views.visible(42) == 42
    assert "\\u202e" in views.shown_json({"name": hostile}).text


def test_every_template_value_goes_through_the_escapes() -> None:
    """The templates' ``finalize``: a value shown in a title, a table cell or an
    attribute is made visible, then HTML-escaped."""
    from alma_core.ui.rendering import environment

    page = environment().from_string("<title>{{ run }}</title><td title='{{ run }}'>{{ run }}")
    html = page.render(run="<b>x</b>\u202egpj.exe")
    assert "\u202e" not in html
    assert html.count("\\u202egpj.exe") == 3
    assert "<b>" not in html


def test_only_the_inspectors_own_host_names_are_answered() -> None:
    loopback = views.LOOPBACK_HOSTS
    for host in ("127.0.0.1:8765", "localhost:8765", "LOCALHOST", "[::1]:8765", "127.0.0.1"):
        assert views.host_allowed(host, loopback), host
    # DNS rebinding: another site's name that resolves here; and what is no name at all
    for host in ("evil.test:8765", "127.0.0.1.evil.test", "", "[::1", "localhost@evil.test"):
        assert not views.host_allowed(host, loopback), host
    assert views.host_allowed("ops.example.com", ["*.example.com"])
    assert not views.host_allowed("example.com.evil.test", ["*.example.com"])
    assert not views.host_allowed("example.com", ["*.example.com"])
    assert views.host_allowed("anything:1", ["*"])


def test_times_are_shown_in_utc_and_say_so() -> None:
    from alma_core.ui.rendering import environment

    at = datetime(2026, 11, 27, 23, 30, tzinfo=timezone(timedelta(hours=2)))
    shown = environment().from_string("{{ at | when }}").render(at=at)
    assert shown == "2026-11-27 21:30:00 UTC"
    precise = at.replace(microsecond=45_678)
    shown = environment().from_string("{{ at | when(ms=True) }}").render(at=precise)
    assert shown == "2026-11-27 21:30:00.045 UTC"


def ev(i: int, kind: str, node: str | None, at: float, **kw: object) -> dict[str, object]:
    return {
        "event_id": f"e{i}",
        "type": kind,
        "node_id": node,
        "branch_id": kw.pop("branch", None),
        "emitted_at": T0 + timedelta(seconds=at),
        "recorded_at": T0 + timedelta(seconds=at + 0.01),
        "effect": kw.pop("effect", "recorded"),
        "checkpoint_seq": kw.pop("seq", None),
        **kw,
    }


def test_a_runs_history_says_how_long_each_node_ran_retries_and_branches_apart() -> None:
    events = [
        ev(1, "node.started", "plan", 0),
        ev(2, "node.started", "fetch", 1, branch="A"),
        ev(3, "node.started", "fetch", 1.2, branch="B"),
        ev(4, "node.completed", "plan", 0.5, seq=1),
        ev(5, "node.failed", "fetch", 3.0, branch="A", attempt=1, seq=2),
        ev(6, "node.started", "fetch", 3.1, branch="A", attempt=2),
        ev(7, "node.completed", "fetch", 3.4, branch="A", attempt=2, seq=3),
        ev(8, "node.completed", "fetch", 2.2, branch="B", seq=4),
        ev(9, "node.completed", "orphan", 5, seq=5),  # no node.started: no duration
        ev(10, "workflow.completed", None, 6, duration_ms=6000),
    ]
    steps = views.steps(events)
    took = {s.event_id: s.took_ms for s in steps}
    assert [s.index for s in steps] == list(range(1, 11))
    assert took["e4"] == 500
    assert took["e5"] == 2000  # the first attempt, from its own start
    assert took["e7"] is not None
    assert round(took["e7"]) == 300  # the retry, from the retry's start
    assert took["e8"] == 1000  # branch B's fetch, not A's
    assert took["e9"] is None
    assert took["e10"] == 6000
    assert steps[5].attempt == 2
    assert steps[0].took_ms is None
    laid = views.timeline(
        [cp(1, event_id="e4"), cp(2, "failure", branch="A", event_id="e5")],
        [],
        [],
        None,
        link="/c?seq={seq}",
        took={s.event_id: s.took_ms for s in steps if s.took_ms is not None},
    )
    assert [item.took_ms for item, _ in laid.rows()] == [500, 2000]


def test_durations_read_in_their_unit_and_pages_clamp() -> None:
    assert [views.took(v) for v in (None, 12.4, 2400, 185_000)] == [
        "",
        "12 ms",
        "2.4 s",
        "3 min 05 s",
    ]
    assert views.page_of(450, 0, 200) == (0, None, 200)
    assert views.page_of(450, 200, 200) == (200, 0, 400)
    assert views.page_of(450, 450, 200) == (400, 200, None)  # past the end: the last page
    assert views.page_of(450, 317, 200) == (200, 0, 400)  # a start inside a page: that page
    assert views.page_of(0, 5, 200) == (0, None, None)
    assert views.page_of(200, -3, 200) == (0, None, None)


def test_a_search_takes_its_text_literally() -> None:
    from alma_core.storage.runs import _contains

    assert _contains("50%_a\\b") == "%50\\%\\_a\\\\b%"
    assert _contains("") is None
    assert _contains(None) is None


def test_counted_says_one_thing_and_many_things() -> None:
    assert views.counted(1, "run") == "1 run"
    assert views.counted(0, "run") == "0 runs"
    assert views.counted(2, "more character") == "2 more characters"
    assert views.counted(3, "memory", "memories") == "3 memories"


def test_memory_rows_label_kinds_in_one_style_and_state_a_fact_once() -> None:
    items = [
        {"type": "Memory", "kind": "anti_pattern", "content": "avoid X", "score": 0.9},
        {"type": "Memory", "kind": "outcome", "content": "node n succeeded", "score": 0.8},
        {"type": "Memory", "kind": "outcome", "content": "node n succeeded", "score": 0.8},
        {"type": "Memory", "kind": "outcome", "content": "node n succeeded", "score": 0.7},
        {"type": "Memory", "kind": "heuristic", "content": "node n succeeded", "score": 0.6},
        {"type": "WorkflowOutcome", "description": "run r succeeded", "score": 0.5},
    ]
    assert views.memory_rows(items) == [
        views.MemoryRow("anti-pattern", 0.9, "avoid X"),
        views.MemoryRow("node outcome", 0.8, "node n succeeded", times=3),
        views.MemoryRow("heuristic", 0.6, "node n succeeded"),  # another kind: its own row
        views.MemoryRow("run outcome", 0.5, "run r succeeded"),
    ]


def test_fields_are_in_natural_order_and_found_by_name_in_any_case() -> None:
    state = {"step10": 10, "step2": 2, "Step1": 1, "a": 0, "10": "ten", "9": "nine", "x²": 0}
    assert [k for k, _ in views.fields_in_order(state)] == [
        "9",
        "10",  # digits by their value, before letters
        "Step1",
        "a",
        "step2",
        "step10",
        "x²",  # a superscript is no digit: text, and no error
    ]
    assert [k for k, _ in views.fields_in_order(state, "STEP")] == ["Step1", "step2", "step10"]
    assert views.fields_in_order(state, "nothing") == []
    assert views.natural("v1.10") > views.natural("v1.9")
