"""The run inspector (`alma ui`) in a real headless browser (Debian's chromium, driven by
Selenium) against the real services: the runs list and its filters, a run with two
branches, a retry, a join and a dead letter on its timeline, a diff, a merge, hostile
content shown escaped, tenants kept apart, writes only when enabled and only from the
inspector's own pages, memory retrieval. Screenshots go to ``$ALMA_UI_SCREENSHOTS``
(docs/img when the docs are refreshed), else the test's temporary directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait
from starlette.applications import Starlette
from starlette.routing import Mount

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.storage.postgres import connect
from alma_core.types import WorkflowContext
from alma_core.ui import create_app
from bench.ui import served
from tests.integration.harness import Publisher, Worker, completed, count, wait_for
from tests.integration.test_cli_runs import env_of
from tests.services import without_alma_settings

pytestmark = pytest.mark.slow

WORKFLOW = "inspect"
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
BIDI = "invoice\u202egpj.exe"  # reads "invoice...exe.jpg" where U+202E is not escaped


def inspector(settings: Settings, *args: str) -> contextlib.AbstractAsyncContextManager[str]:
    """`alma ui` in a process of its own, as a user starts it; its base URL."""
    environ = {**without_alma_settings(), **env_of(settings), "ALMA_METRICS_PORT": "0"}
    return served(environ, *args)


@contextlib.contextmanager
def browser(*flags: str) -> Iterator[WebDriver]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        raise AssertionError(
            "the browser tests need Debian's chromium and chromium-driver: `make tools` "
            "installs them (apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,1000",
        *flags,
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("ALMA_UI_SCREENSHOTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


def follow(driver: WebDriver, by: str, what: str) -> None:
    """Click the element (a link, a form's button) and wait for the page it loads."""
    old = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(by, what).click()
    # mid-navigation chromedriver may answer "Node ... does not belong to the document"
    # rather than "stale element": either means the old page is gone
    WebDriverWait(driver, 30, ignored_exceptions=[WebDriverException]).until(
        expected_conditions.staleness_of(old)
    )
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def counted(driver: WebDriver, css: str) -> int:
    return int(driver.execute_script("return document.querySelectorAll(arguments[0]).length", css))


def texts(driver: WebDriver, css: str) -> list[str]:
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


async def make_runs(settings: Settings, client: AlmaClient, run: str, hostile: str) -> None:
    """A run with two branches, a merge, a retry, a dead letter and its completion; a
    run with hostile content; another tenant's run."""

    def at(node: str, branch: str | None = None, r: str = run, t: str = "acme") -> WorkflowContext:
        return WorkflowContext(t, WORKFLOW, None, r, node, branch)

    async def done(ctx: WorkflowContext, **kw: Any) -> None:
        await client.applied(ctx, await client.node_completed(ctx, **kw))

    await client.register_reducers(at("plan"), {"n": "sum", "notes": "append"})
    await done(at("plan"), state={"n": 1, "notes": ["plan"], "title": "<b>plan</b>"})
    await done(at("research", "A"), updates={"n": 2, "notes": ["a"]})
    await done(at("draft", "B"), updates={"n": 3, "notes": ["b"]})
    await client.merge(at("join"), branch_ids=["A", "B"])
    failed = await client.node_failed(at("check"), error_type="Timeout", message="slow", attempt=1)
    await client.applied(at("check"), failed)
    await done(at("check"), updates={"n": 4, "notes": ["checked"]})
    stale = await client.node_completed(at("late"), updates={"n": 1}, expected_seq=1)
    with pytest.raises(errors.RejectedEvent, match="expected 1"):
        await client.applied(at("late"), stale)
    finished = await client.workflow_completed(
        at("end"), success=True, duration_ms=1200, node_count=5, nodes_succeeded=5, nodes_failed=0
    )
    await client.applied(at("end"), finished)

    await done(at("open", r=hostile), state={"html": HOSTILE, "tail": "y" * 60_000})
    # bidirectional and control characters, in a node id and an error message
    spoof = await client.node_failed(
        at(BIDI, r=hostile), error_type="Spoof\u2066", message=f"open {BIDI}\x1b[2J", attempt=1
    )
    await client.applied(at(BIDI, r=hostile), spoof)
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        # 300 KB of hostile text: over the state limit, a dead letter of 300 KB
        await pub.send(completed(hostile, node="huge", state={"s": HOSTILE * 4000}))
        # NUL bytes: in the key as sent, and a NUL character in a state (which
        # PostgreSQL's jsonb cannot hold)
        nul = completed(hostile, node="nul", state={"s": "a\u0000b" + HOSTILE})
        await pub.send(nul, key=b"k\x00\x01" + hostile.encode())
        await pub.flush()
    await done(at("solo", r=f"beta-run-{run}", t="beta"), state={"beta": True})
    # a run blocked by a dead letter of its own: a write that expected another seq, and
    # nothing after it
    blocked = f"{run}-blocked"
    await done(at("first", r=blocked), state={"k": 1})
    refused = await client.node_completed(at("second", r=blocked), updates={"k": 2}, expected_seq=5)
    with pytest.raises(errors.RejectedEvent, match="expected 5"):
        await client.applied(at("second", r=blocked), refused)
    # a write that came early (it expects seq 2, the run is at 1): dead-lettered; then
    # the run reaches seq 2, and the letter, replayed, would apply
    early = f"{run}-early"
    await done(at("first", r=early), state={"k": 1})
    ahead = await client.node_completed(at("ahead", r=early), updates={"k": 9}, expected_seq=2)
    with pytest.raises(errors.RejectedEvent, match="expected 2"):
        await client.applied(at("ahead", r=early), ahead)
    await done(at("second", r=early), updates={"k": 2})


async def test_the_inspector_shows_runs_timelines_diffs_and_keeps_tenants_apart(
    settings: Settings, embedder: AsyncEmbedder, tmp_path: Path
) -> None:
    dsn = settings.postgres_dsn or ""
    run, hostile = f"ui-{uuid.uuid4().hex[:6]}", f"ui-hostile-{uuid.uuid4().hex[:6]}"
    async with (
        Worker.start(settings, ("checkpointer", "joiner", "learner"), embedder),
        AlmaClient(settings) as client,
    ):
        await make_runs(settings, client, run, hostile)
        await wait_for(
            lambda: count(dsn, "SELECT count(*) FROM workflow_outcomes WHERE run_id = $1", run),
            what="the run learned from",
        )
        await wait_for(
            lambda: count(dsn, "SELECT count(*) >= 2 FROM dead_letters WHERE run_id = $1", hostile),
            what="the hostile run's dead letters",
        )
        out = shots(tmp_path)
        async with (
            inspector(settings, "--tenant", "acme") as acme,
            inspector(settings, "--tenant", "beta") as beta,
            inspector(settings, "--tenant", "acme", "--allow-writes") as writable,
        ):
            await asyncio.to_thread(read_only_pages, acme, beta, run, hostile, out)
            await asyncio.to_thread(writes, acme, writable, run, out)


def read_only_pages(acme: str, beta: str, run: str, hostile: str, out: Path) -> None:
    with browser() as driver:
        # the runs list, newest first, with its counts and filters
        driver.get(f"{acme}/runs")
        assert driver.find_element(By.ID, "tenant").text == "acme"
        listed = texts(driver, "#runs a.run")
        assert set(listed) == {run, hostile, f"{run}-early", f"{run}-blocked"}
        assert texts(driver, "#count-succeeded") == ["1"]
        assert texts(driver, "#count-running") == ["1"]  # the early run
        assert texts(driver, "#count-blocked") == ["1"]  # waits on its refused write
        # triage from the list: a failed run's failing node and error, each run's duration
        row = driver.find_element(By.XPATH, f"//tr[.//a[text()='{hostile}']]")
        assert row.find_element(By.CSS_SELECTOR, "td.error-type").text == "Spoof\\u2066"
        assert row.find_element(By.CSS_SELECTOR, "td.failing-node").text.startswith("invoice")
        done_row = driver.find_element(By.XPATH, f"//tr[.//a[text()='{run}']]")
        assert re.fullmatch(
            r"[\d.]+ (ms|s)", done_row.find_element(By.CSS_SELECTOR, "td.duration").text
        )
        assert done_row.find_element(By.CSS_SELECTOR, "td.error-type").text == ""  # succeeded
        assert texts(driver, "#count-failed") == ["1"]  # the hostile run: a node failed
        driver.save_screenshot(str(out / "ui-runs.png"))
        Select(driver.find_element(By.NAME, "status")).select_by_value("succeeded")
        follow(driver, By.ID, "filter")
        assert texts(driver, "#runs a.run") == [run]
        driver.get(f"{acme}/runs?q=HOSTILE")  # search ignores case
        assert texts(driver, "#runs a.run") == [hostile]
        driver.get(f"{acme}/runs?node=Check")  # a node that checkpointed in the run
        assert texts(driver, "#runs a.run") == [run]
        driver.get(f"{acme}/runs?error=SLOW")  # a failure's type or message
        assert texts(driver, "#runs a.run") == [run]
        driver.get(f"{acme}/runs?error=spoof&status=failed")  # together with a status
        assert texts(driver, "#runs a.run") == [hostile]
        driver.get(f"{acme}/runs?error=spoof&node=check")  # every condition at once
        assert texts(driver, "#runs a.run") == []
        driver.get(f"{acme}/runs?since=2999-01-01T00:00")
        assert texts(driver, "#runs a.run") == []

        # the run: lanes, a retry, the merge, the dead letter, the end, what was learned
        driver.get(f"{acme}/runs")
        follow(driver, By.LINK_TEXT, run)
        assert driver.find_element(By.ID, "run-id").text == run
        lanes = texts(driver, "#timeline thead th")
        assert lanes[:4] == ["seq", "main", "A", "B"]
        cells = driver.find_elements(By.CSS_SELECTOR, "#timeline td.item")
        kinds = [(c.get_attribute("data-kind"), c.get_attribute("data-lane")) for c in cells]
        assert ("node", "A") in kinds
        assert ("node", "B") in kinds
        assert ("merge", "main") in kinds
        assert ("failure", "main") in kinds
        assert ("dead_letter", "dead letters") in kinds
        assert kinds[-1] == ("completed", "end")
        failure = next(c for c in cells if c.get_attribute("data-kind") == "failure")
        assert "check failed (attempt 1)" in failure.text
        assert "Timeout: slow" in failure.text
        assert "succeeded" in driver.find_element(By.ID, "outcome").text
        driver.save_screenshot(str(out / "ui-run.png"))
        # its graph: the nodes it reached, each by its outcome, and the edges it took
        boxes = driver.find_elements(By.CSS_SELECTOR, "#graph g.gnode")
        drawn = {
            (b.get_attribute("data-lane"), b.get_attribute("data-node")): b.get_attribute(
                "data-status"
            )
            for b in boxes
        }
        assert drawn == {
            ("main", "plan"): "succeeded",
            ("A", "research"): "succeeded",
            ("B", "draft"): "succeeded",
            ("main", "join"): "merge",
            ("main", "check"): "retried",  # failed once, then succeeded
            ("main", "(end)"): "succeeded",
            # apart, below: what the workflow's other finished run (the hostile one)
            # reached and this one did not
            ("main", "open"): "never reached",
            ("main", "invoice\\u202egpj.exe"): "never reached",  # BIDI, escaped
        }
        apart = driver.find_elements(By.CSS_SELECTOR, "#graph g.unreached")
        assert {a.find_element(By.CSS_SELECTOR, "text.gnote").text for a in apart} == {
            "never reached; 1/1 do"
        }
        assert not driver.find_elements(By.CSS_SELECTOR, "#graph g.unreached a")  # no checkpoint
        # plan to each branch and on to the merge, both branches into it, then on
        assert len(driver.find_elements(By.CSS_SELECTOR, "#graph path.edge")) == 7
        link = driver.find_element(By.CSS_SELECTOR, "#graph g.retried a")
        assert (link.get_dom_attribute("href") or "").endswith("&seq=6")  # its latest checkpoint
        driver.find_element(By.ID, "graph").screenshot(str(out / "ui-graph.png"))
        # its time: a row per node of each lane, each attempt a bar
        rows = driver.find_elements(By.CSS_SELECTOR, "#gantt g.grow")
        bars = {
            (r.get_attribute("data-lane"), r.get_attribute("data-node")): [
                (b.get_attribute("class") or "").split()[-1]
                for b in r.find_elements(By.CSS_SELECTOR, "rect.bar")
            ]
            for r in rows
        }
        assert bars == {
            ("main", "plan"): ["succeeded"],
            ("main", "check"): ["failed", "succeeded"],  # the retry: two segments
            ("A", "research"): ["succeeded"],
            ("B", "draft"): ["succeeded"],
        }

        # a blocked run: its status, and the letter it waits on first, a link away
        driver.get(f"{acme}/run?id={run}-blocked")
        assert driver.find_element(By.ID, "status").text == "blocked"
        waiting = driver.find_element(By.ID, "run-blocked")
        assert "stale_expected_seq" in waiting.text
        assert waiting.find_elements(By.CSS_SELECTOR, "a[href*='/dead-letters']")
        driver.save_screenshot(str(out / "ui-blocked.png"))
        # two runs compared: where the early run and the run part, and their states there
        driver.get(f"{acme}/run?id={run}")
        driver.find_element(By.ID, "compare-with").send_keys(f"{run}-early")
        follow(driver, By.ID, "compare-runs")
        assert "They part at step 1: A ran plan" in driver.find_element(By.ID, "parted").text
        assert driver.find_elements(By.CSS_SELECTOR, "#first-difference")
        assert "/k" in texts(driver, "#changes td.path")
        driver.save_screenshot(str(out / "ui-compare.png"))
        driver.get(f"{acme}/run?id={run}")

        # a checkpoint: its state and its changes; the merge with each field's reducer
        follow(driver, By.CSS_SELECTOR, "td.merge a")
        assert driver.find_element(By.ID, "seq").text == "4"
        merge_rows = texts(driver, "#merge tbody tr")
        assert any(row.startswith("n sum") for row in merge_rows), merge_rows
        assert json.loads(driver.find_element(By.ID, "state").text)["n"] == 6
        driver.save_screenshot(str(out / "ui-merge.png"))

        # a diff of any two checkpoints: the changed keys
        driver.get(f"{acme}/run?id={run}")
        follow(driver, By.ID, "compare")
        paths = texts(driver, "#changes td.path")
        assert "/n" in paths
        assert "/notes/1" in paths
        driver.save_screenshot(str(out / "ui-diff.png"))

        # hostile content: shown as text, cut, never run
        driver.get(f"{acme}/checkpoint?id={hostile}&seq=1")
        state = driver.find_element(By.ID, "state").text
        assert "<script>window.__pwned = 1</script>" in state
        assert driver.find_elements(By.CSS_SELECTOR, "main img, main script") == []
        assert driver.execute_script("return window.__pwned === undefined")
        assert "more characters not shown" in driver.find_element(By.ID, "state-cut").text
        # bidirectional and control characters: escapes, in the timeline and the page
        driver.get(f"{acme}/run?id={hostile}")
        page = driver.find_element(By.TAG_NAME, "body").text
        assert "invoice\\u202egpj.exe" in page
        assert "Spoof\\u2066" in page
        assert "\\x1b[2J" in page
        assert not {"\u202e", "\u2066", "\x1b"} & set(page + driver.title)
        driver.get(f"{acme}/dead-letters")
        records = texts(driver, "pre.record")
        assert any(HOSTILE[:30] in r for r in records)
        assert any("bytes in all" in t for t in texts(driver, ".cut"))
        keys = texts(driver, ".record-key")
        assert any(k.startswith("k\\x00\\x01") for k in keys), keys
        assert driver.execute_script("return window.__pwned === undefined")
        assert driver.find_elements(By.CSS_SELECTOR, "main img, main script") == []
        assert driver.find_elements(By.CSS_SELECTOR, "button.replay") == []  # read-only
        driver.save_screenshot(str(out / "ui-dead-letters.png"))

        # another tenant: none of acme's runs, and acme's run is not found
        driver.get(f"{beta}/runs")
        assert texts(driver, "#runs a.run") == [f"beta-run-{run}"]
        driver.get(f"{beta}/run?id={run}")
        assert "has no run" in driver.find_element(By.ID, "error").text
        # what to do next, in the browser: back to the runs list
        assert "runs list" in driver.find_element(By.ID, "next-step").text
        driver.get(f"{acme}/runs?tenant=beta")
        assert "no tenant 'beta' here" in driver.find_element(By.ID, "error").text

        # memory: the retrieval box ranks what the learner made of the run
        driver.get(f"{acme}/memory")
        driver.find_element(By.NAME, "task").send_keys("plan, research and draft a report")
        follow(driver, By.ID, "retrieve")
        assert texts(driver, "#items tbody tr")
        assert WORKFLOW in driver.find_element(By.ID, "prompt").text
        driver.save_screenshot(str(out / "ui-memory.png"))


def writes(acme: str, writable: str, run: str, out: Path) -> None:
    # a read-only inspector refuses a write, whatever its origin
    refused = httpx.post(
        f"{acme}/fork", data={"id": run, "seq": "1", "new_run_id": "x"}, headers={"origin": acme}
    )
    assert refused.status_code == 403
    assert "writes are off" in refused.text
    # a writable one refuses a form posted from another site's page
    forged = httpx.post(
        f"{writable}/fork",
        data={"id": run, "seq": "1", "new_run_id": "forged"},
        headers={"origin": "http://evil.example"},
    )
    assert forged.status_code == 403
    # DNS rebinding: a page of another site whose name resolves to the inspector's
    # address reads nothing and writes nothing, Origin and Host agreeing or not
    port = urlsplit(writable).port
    rebound = f"http://rebound.test:{port}"
    rebound_fork = httpx.post(
        f"{writable}/fork",
        data={"id": run, "seq": "1", "new_run_id": "rebound"},
        headers={"host": f"rebound.test:{port}", "origin": rebound},
    )
    assert rebound_fork.status_code == 400
    with browser("--host-resolver-rules=MAP rebound.test 127.0.0.1") as driver:
        driver.get(f"{rebound}/runs")
        body = driver.find_element(By.TAG_NAME, "body").text
        assert "answers to 127.0.0.1, localhost, ::1, not to 'rebound.test:" in body
        assert run not in body
        driver.get(f"{rebound}/run?id={run}")
        assert run not in driver.find_element(By.TAG_NAME, "body").text
    with browser() as driver:
        driver.get(f"{writable}/checkpoint?id={run}&seq=1")
        forked = f"{run}-fork"
        driver.find_element(By.ID, "new-run-id").send_keys(forked)
        follow(driver, By.ID, "fork")
        assert driver.find_element(By.ID, "run-id").text == forked
        assert run in driver.find_element(By.CSS_SELECTOR, ".facts").text  # forked from
        driver.save_screenshot(str(out / "ui-fork.png"))
        # a dead letter that would be refused again is not sent back, and says why
        driver.get(f"{writable}/dead-letters?reason=stale_expected_seq")
        late, early = (letter_of(driver, r) for r in (run, f"{run}-early"))
        follow(driver, By.CSS_SELECTOR, f"#{late} button.replay")
        refused = driver.find_element(By.ID, "error").text
        assert "would be refused again" in refused
        assert "is completed (succeeded)" in refused
        driver.get(f"{writable}/dead-letters?reason=stale_expected_seq")
        assert "replayed" not in driver.find_element(By.CSS_SELECTOR, f"#{late} h2").text
        # one that would apply now is sent back once: its button goes, and a second ask
        # (another tab, a resent form) is refused
        follow(driver, By.CSS_SELECTOR, f"#{early} button.replay")
        assert "sent back" in driver.find_element(By.ID, "replayed").text
        assert "replayed" in driver.find_element(By.CSS_SELECTOR, f"#{early} h2").text
        assert driver.find_elements(By.CSS_SELECTOR, f"#{early} button.replay") == []
        driver.save_screenshot(str(out / "ui-dead-letters-replayed.png"))
    again = httpx.post(
        f"{writable}/dead-letters/{early.removeprefix('letter-')}/replay",
        headers={"origin": writable},
    )
    assert again.status_code == 409
    assert "replayed already" in again.text
    # the replayed write applied: the early run is at seq 3
    for _ in range(300):
        page = httpx.get(f"{writable}/run?id={run}-early").text
        if "<dt>checkpoints</dt><dd>3</dd>" in page:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the replayed write was not applied within 30 s")


async def test_big_runs_page_their_history_and_live_pages_keep_what_the_user_typed(
    settings: Settings, tmp_path: Path
) -> None:
    """Issue 51, items 10 and 11 and the event history: a 10,000-key state's changes come
    a page at a time, with the whole state one link away; dead letters page past 50; a
    256-character run id and a 400-pixel window widen no page; a run's history says when
    each event came, its attempt and how long each node ran; a live page updates without
    a reload, keeping what the user typed and unfolded."""
    settings = settings.model_copy(update={"max_state_bytes": 1_000_000})  # 10,000 keys
    run, tag = f"big-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]
    long_id = f"long-{tag}-" + "x" * (256 - len(f"long-{tag}-"))
    live = f"live-{tag}"

    def at(node: str, r: str = run, branch: str | None = None) -> WorkflowContext:
        return WorkflowContext("acme", WORKFLOW, None, r, node, branch)

    async with (
        Worker.start(settings, ("checkpointer", "joiner")),
        AlmaClient(settings) as client,
    ):

        async def done(ctx: WorkflowContext, **kw: Any) -> None:
            await client.applied(ctx, await client.node_completed(ctx, **kw))

        await done(at("plan"), state={"k": 0})
        wide = {f"key-{i:05d}": i for i in range(9_999)}
        await done(at("wide"), updates={"a-long": "z" * 3000, **wide})  # 10,000 changes
        stale = [
            await client.node_completed(at(f"stale-{i}"), updates={"n": i}, expected_seq=99)
            for i in range(55)
        ]
        for event_id in stale:
            with pytest.raises(errors.RejectedEvent):
                await client.applied(at("stale"), event_id)
        await done(at("solo", r=long_id), state={"id": long_id})
        # a run with a retry, its starts included: how long each node ran
        await client.node_started(at("plan", live), attempt=1)
        await done(at("plan", live), state={"n": 1})
        await client.node_started(at("fetch", live), attempt=1)
        failed = await client.node_failed(
            at("fetch", live), error_type="Timeout", message="upstream slow", attempt=1
        )
        await client.applied(at("fetch", live), failed)
        await client.node_started(at("fetch", live), attempt=2)
        await done(at("fetch", live), updates={"n": 2})
        wide_run = f"wide-{tag}"
        await make_wide_run(client, wide_run)

        out = shots(tmp_path)
        async with inspector(settings, "--tenant", "acme") as acme:
            await asyncio.to_thread(big_pages, acme, run, long_id, live, out)
            await asyncio.to_thread(wide_pages, acme, wide_run, live, out)
            opened, seen = threading.Event(), threading.Event()
            watching = asyncio.create_task(
                asyncio.to_thread(live_pages, acme, live, out, opened, seen)
            )
            # what the open pages see arrive, without a reload
            await wait_for(lambda: _flag(opened, watching), what="the live pages open")
            await done(at("check", live), updates={"n": 3})
            await done(at("solo", r=f"new-{tag}"), state={"new": True})
            await wait_for(lambda: _flag(seen, watching), what="the live pages updated")
            finished = await client.workflow_completed(
                at("end", live),
                success=False,
                duration_ms=4200,
                node_count=3,
                nodes_succeeded=2,
                nodes_failed=1,
                error_message="fetch gave up after 2 attempts",
            )
            await client.applied(at("end", live), finished)
            await watching


WIDE_WORKFLOW = "fan-out"
RETRIED, FAILED, RUNNING = {(1, 2), (3, 4)}, (4, 5), (5, 5)  # (branch, step)


async def make_wide_run(client: AlmaClient, run: str) -> None:
    """30 nodes: plan, 5 branches of 5 steps (two retried once, one failed for good, one
    still running), a merge of the three that finished, then review, edit, publish on
    the main line; then a write that expected another seq, refused: the run is stuck."""

    def at(node: str, branch: str | None = None) -> WorkflowContext:
        return WorkflowContext("acme", WIDE_WORKFLOW, None, run, node, branch)

    async def done(ctx: WorkflowContext, **kw: Any) -> None:
        await client.applied(ctx, await client.node_completed(ctx, **kw))

    async def failed(ctx: WorkflowContext, kind: str) -> None:
        await client.applied(ctx, await client.node_failed(ctx, error_type=kind, message="x"))

    await done(at("plan"), state={"n": 0})
    for b in range(1, 6):
        for step in range(1, 6):
            ctx = at(f"b{b}-step{step}", f"b{b}")
            await client.node_started(ctx, attempt=1)
            if (b, step) in RETRIED:
                await failed(ctx, "Flaky")
                await client.node_started(ctx, attempt=2)
            if (b, step) == FAILED:
                await failed(ctx, "Fatal")
            elif (b, step) != RUNNING:
                await done(ctx, updates={"n": b * 10 + step})
    await client.merge(at("gather"), branch_ids=["b1", "b2", "b3"], reducers={"n": "max"})
    for node in ("review", "edit", "publish"):
        await done(at(node), updates={"n": 99})
    stale = await client.node_completed(at("late"), updates={"n": 1}, expected_seq=1)
    with pytest.raises(errors.RejectedEvent, match="expected 1"):
        await client.applied(at("late"), stale)


async def _flag(reached: threading.Event, browsing: asyncio.Task[None]) -> bool:
    """The browser's thread got so far, or ended (its failure is raised where it is
    awaited)."""
    return reached.is_set() or browsing.done()


def big_pages(acme: str, run: str, long_id: str, live: str, out: Path) -> None:
    with browser() as driver:
        # 10,000 changes: 200 to a page, the rest a link away
        driver.get(f"{acme}/checkpoint?id={run}&seq=2")
        shown = driver.find_elements(By.CSS_SELECTOR, "#changes tbody tr")
        assert len(shown) == 200, driver.find_element(By.TAG_NAME, "main").text[:500]
        paging = driver.find_element(By.ID, "changes-paging").text
        assert "changes 1–200 of 10000" in paging
        assert len(driver.page_source) < 400_000  # not 2 MB of HTML
        # a value cut in the table links to the whole of it
        more = driver.find_element(By.CSS_SELECTOR, "#changes a.more").get_attribute("href")
        assert httpx.get(more or "").json() == "z" * 3000
        follow(driver, By.ID, "changes-later")
        assert "changes 201–400 of 10000" in driver.find_element(By.ID, "changes-paging").text
        assert texts(driver, "#changes td.path")[0] == "/key-00199"
        assert "more characters not shown" in driver.find_element(By.ID, "state-cut").text
        # a state too big to show whole is shown field by field, 200 a page, folded
        fields = driver.find_element(By.ID, "fields-paging").text
        assert "fields 1–200 of 10001" in fields
        follow(driver, By.ID, "fields-later")
        assert texts(driver, "#state-fields td.path")[0] == "key-00198"  # after a-long, k
        folded = driver.find_element(By.CSS_SELECTOR, "#state-fields details")
        assert folded.get_attribute("open") is None
        folded.find_element(By.TAG_NAME, "summary").click()
        assert folded.find_element(By.TAG_NAME, "pre").text == "198"
        whole = httpx.get(driver.find_element(By.ID, "state-json").get_attribute("href") or "")
        assert whole.headers["content-type"] == "application/json"
        assert len(whole.json()) == 10_001
        command = driver.find_element(By.ID, "state-cli").text
        assert command.startswith(f"alma runs state {run} --seq 2")
        # its copy button puts it on the clipboard
        driver.execute_cdp_cmd(
            "Browser.grantPermissions",
            {"origin": acme, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
        )
        driver.find_element(By.CSS_SELECTOR, "button[data-copy=state-cli]").click()
        WebDriverWait(driver, 10).until(
            lambda d: (
                d.find_element(By.CSS_SELECTOR, "button[data-copy=state-cli]").text == "copied"
            )
        )
        pasted = driver.execute_async_script(
            "navigator.clipboard.readText().then(arguments[arguments.length - 1])"
        )
        assert pasted == command
        driver.save_screenshot(str(out / "ui-changes-paged.png"))
        # dead letters past the first 50, and each one's own address
        driver.get(f"{acme}/dead-letters")
        assert len(driver.find_elements(By.CSS_SELECTOR, "section.letter")) == 50
        follow(driver, By.ID, "letters-older")
        assert len(driver.find_elements(By.CSS_SELECTOR, "section.letter")) == 6  # + the wide's
        follow(driver, By.CSS_SELECTOR, "section.letter a.permalink")
        assert len(driver.find_elements(By.CSS_SELECTOR, "section.letter")) == 1
        assert driver.find_elements(By.ID, "letters-newest")
        # a run's time to scale: the retried node's two attempts, the gap between them
        driver.get(f"{acme}/run?id={live}")
        fetch = driver.find_elements(By.CSS_SELECTOR, "#gantt g.grow[data-node='fetch'] rect.bar")
        assert [(b.get_attribute("class") or "").split()[-1] for b in fetch] == [
            "failed",
            "succeeded",
        ]
        first, second = (float(b.get_attribute("x") or 0) for b in fetch)
        assert second > first
        driver.find_element(By.ID, "gantt").screenshot(str(out / "ui-gantt.png"))
        # a 256-character id and a phone-sized window: nothing wider than the window
        driver.set_window_size(400, 900)
        for page in (
            "/runs",
            f"/run?id={long_id}",
            f"/run?id={run}",
            f"/checkpoint?id={run}&seq=2",
            f"/compare?id={run}&with={live}",
            "/dead-letters",
            "/memory",
        ):
            driver.get(f"{acme}{page}")
            wide = driver.execute_script(
                "return [document.documentElement.scrollWidth, window.innerWidth]"
            )
            assert wide[0] <= wide[1], (page, wide)
            # and with another machine's fonts: a field's width follows its font (the
            # memory page's task field widened the page to 425 px on a fresh machine)
            wide = driver.execute_script(
                "for (const e of document.querySelectorAll('input, select'))"
                "  e.style.font = '16px monospace';"  # the CSSOM: the page's CSP allows it
                "return [document.documentElement.scrollWidth, window.innerWidth]"
            )
            assert wide[0] <= wide[1], (page, "a wider font", wide)
        driver.get(f"{acme}/runs")
        driver.save_screenshot(str(out / "ui-narrow.png"))


def wide_pages(acme: str, wide: str, live: str, out: Path) -> None:
    """A run of 30 nodes in 5 branches, at 1400 and at 400 px: its graph, its time, its
    stuck state and its comparison with another run, by what they show."""
    with browser() as driver:
        # the runs list: stuck, with what it waits on a click away
        driver.get(f"{acme}/runs?workflow={WIDE_WORKFLOW}")
        assert texts(driver, "#runs a.run") == [wide]
        assert texts(driver, "#runs .badge") == ["blocked"]
        for width in (1400, 400):
            driver.set_window_size(width, 1000)
            driver.get(f"{acme}/run?id={wide}")
            assert driver.find_element(By.ID, "status").text == "blocked"
            assert "expected 1" in driver.find_element(By.ID, "run-blocked").text
            boxes = driver.find_elements(By.CSS_SELECTOR, "#graph g.gnode")
            status = Counter(b.get_attribute("data-status") for b in boxes)
            assert status == {
                "succeeded": 25,  # plan, 21 branch steps, review, edit, publish
                "retried": 2,
                "failed": 1,
                "running": 1,
                "merge": 1,
            }, status
            lanes = texts(driver, "#graph text.lane")
            assert lanes == ["main", "b1", "b2", "b3", "b4", "b5"]
            places = {
                (r.get_attribute("x"), r.get_attribute("y"))
                for r in driver.find_elements(By.CSS_SELECTOR, "#graph g.gnode rect")
            }
            assert len(places) == 30  # no two boxes in one place
            merge = driver.find_element(By.CSS_SELECTOR, "#graph g.merge text.gnote").text
            assert merge == "merge: n: max"
            # into the merge from each of the three heads it folded
            failed = driver.find_element(By.CSS_SELECTOR, "#graph g.failed")
            assert failed.get_attribute("data-node") == "b4-step5"
            running = driver.find_element(By.CSS_SELECTOR, "#graph g.running")
            assert running.get_attribute("data-node") == "b5-step5"
            # the time: a row per node, the retries two bars, the running one open
            rows = driver.find_elements(By.CSS_SELECTOR, "#gantt g.grow")
            assert len(rows) == 29  # every node but the merge
            bars = Counter(
                (b.get_attribute("class") or "").split()[-1]
                for b in driver.find_elements(By.CSS_SELECTOR, "#gantt rect.bar")
            )
            assert (bars["failed"], bars["running"]) == (3, 1), bars
            # at 400 px the page is as wide as the window; the drawings scroll inside
            page, window, graph_inside, graph_whole = driver.execute_script(
                "const g = document.getElementById('graph');"
                "return [document.documentElement.scrollWidth, window.innerWidth,"
                "        g.clientWidth, g.scrollWidth]"
            )
            assert page <= window, (width, page, window)
            if width == 400:
                assert graph_whole > graph_inside  # 6 lanes: it scrolls in its box
                driver.save_screenshot(str(out / "ui-wide-narrow.png"))
            else:
                driver.find_element(By.ID, "graph").screenshot(str(out / "ui-wide-graph.png"))
                driver.find_element(By.ID, "gantt").screenshot(str(out / "ui-wide-gantt.png"))
            # compared with another run: the step where they part, said in words
            driver.get(f"{acme}/compare?id={wide}&with={live}")
            parted = driver.find_element(By.ID, "parted").text
            assert parted.startswith("They part at step 1"), parted  # plan, another state
            page, window = driver.execute_script(
                "return [document.documentElement.scrollWidth, window.innerWidth]"
            )
            assert page <= window, (width, "compare", page, window)
            if width == 1400:
                driver.save_screenshot(str(out / "ui-wide-compare.png"))


def live_pages(
    acme: str, live: str, out: Path, opened: threading.Event, seen: threading.Event
) -> None:
    with browser() as driver, browser() as runs_driver:
        driver.get(f"{acme}/run?id={live}")
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-refresh") == "3"
        # the history: every event, its attempt, how long each node ran
        rows = driver.find_elements(By.CSS_SELECTOR, "#events tbody tr")
        kinds = [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows]
        assert kinds == [
            "node.started",
            "node.completed",
            "node.started",
            "node.failed",
            "node.started",
            "node.completed",
        ]
        attempts = [r.find_elements(By.TAG_NAME, "td")[4].text for r in rows]
        assert attempts[3:5] == ["1", "2"]
        ran = texts(driver, "#events td.took")
        assert ran[1].endswith(("ms", " s"))
        assert ran[3].endswith(("ms", " s"))
        assert ran[0] == ""
        assert any("ran " in t for t in texts(driver, "#timeline td.item"))
        driver.find_element(By.CSS_SELECTOR, "#event-2 summary").click()  # unfold a payload
        driver.execute_script("window.__kept = 1")
        sent = driver.find_element(By.CSS_SELECTOR, "#event-1 td.when").text
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC", sent), sent
        driver.execute_script("document.getElementById('history').scrollIntoView()")
        driver.save_screenshot(str(out / "ui-history.png"))
        # the runs list, live, with a half-typed filter in focus
        runs_driver.get(f"{acme}/runs?live=1")
        runs_driver.execute_script("window.__kept = 1")
        typed = runs_driver.find_element(By.NAME, "q")
        typed.send_keys("half-typ")
        before = len(texts(runs_driver, "#runs a.run"))
        opened.set()

        # (counted by script: a part swapped while read would be a stale element)
        WebDriverWait(driver, 30).until(lambda d: counted(d, "#events tbody tr") == 7)
        WebDriverWait(runs_driver, 30).until(lambda d: counted(d, "#runs a.run") == before + 1)
        seen.set()
        for d in (driver, runs_driver):
            assert d.execute_script("return window.__kept") == 1  # never reloaded
        assert typed.get_attribute("value") == "half-typ"
        assert runs_driver.switch_to.active_element == typed
        assert driver.find_element(By.CSS_SELECTOR, "#event-2 details").get_attribute("open")
        # the run completes: the page says so, and stops updating
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.ID, "run-failure"))
        assert "fetch gave up" in driver.find_element(By.ID, "run-failure").text
        # started and completed by one clock (the publisher's), and how long between
        facts = driver.find_element(By.ID, "run-facts").text
        assert re.search(r"completed\s.*\(sent\): \S+ (ms|s) after its first event", facts), facts
        WebDriverWait(driver, 30).until(
            lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-refresh") is None
        )
        assert driver.execute_script("return window.__kept") == 1
        # a failure's error reads as its type and message, not a Python dict
        driver.get(f"{acme}/checkpoint?id={live}&seq=2")
        assert driver.find_element(By.ID, "cp-error").text.startswith("Timeout: upstream slow")


async def test_the_runs_list_pages_forward_and_back_in_every_order(settings: Settings) -> None:
    """120 runs, many created in the same microsecond, of equal durations and statuses:
    in each order (by creation, duration or status, either way) "next →" walks them
    all once, in that order, and "← previous" walks back through the same pages."""
    dsn = settings.postgres_dsn or ""
    async with connect(dsn, max_size=1) as pool:
        await pool.execute(
            """INSERT INTO runs (run_id, tenant_id, workflow_id, created_at, status,
                                 completed_at)
               SELECT 'p-' || lpad(g::text, 3, '0'), 'acme', 'paged', at,
                      (ARRAY['running', 'failed', 'succeeded', 'succeeded'])[g % 4 + 1],
                      CASE WHEN g % 4 > 0 THEN at + (g % 5) * interval '1 second' END
               FROM generate_series(1, 120) g,
                    LATERAL (SELECT timestamptz '2026-11-01 12:00Z'
                                    + (g / 7) * interval '1 second' AS at) t"""
        )
    link = re.compile(r'id="(next|newer)" href="([^"]+)"')

    as_of: list[bool] = []  # each later page says when running runs' durations were taken

    def pages(base: str, first: str) -> tuple[list[list[str]], list[list[str]]]:
        def get(url: str) -> tuple[list[str], dict[str, str]]:
            page = httpx.get(base + url.replace("&amp;", "&"))
            assert page.status_code == 200, page.text
            listed = re.findall(r'<a class="run" href="[^"]+">([^<]+)</a>', page.text)
            if url != first:
                as_of.append('id="as-of"' in page.text)
            return listed, dict(link.findall(page.text))

        down, up = [], []
        listed, links = get(first)
        down.append(listed)
        assert "newer" not in links
        while "next" in links and len(down) < 10:
            listed, links = get(links["next"])
            down.append(listed)
        up.append(listed)
        while "newer" in links and len(up) < 10:
            listed, links = get(links["newer"])
            up.append(listed)
        return down, up

    def created(g: int) -> int:
        return g // 7

    def duration(g: int) -> float:  # running: as of now, so the oldest is the longest
        return (g % 5) * 1.0 if g % 4 else 1e9 - created(g)

    rank = {"succeeded": 1, "running": 2, "failed": 5}  # worst last

    def status(g: int) -> int:
        return rank[("running", "failed", "succeeded", "succeeded")[g % 4]]

    keys = {"created": lambda g: (), "duration": lambda g: (duration(g),)}
    keys["status"] = lambda g: (status(g),)
    async with inspector(settings, "--tenant", "acme") as acme:
        # a sort the list does not know is refused, saying which it knows
        refused = await asyncio.to_thread(httpx.get, f"{acme}/runs?sort=colour")
        assert refused.status_code == 400
        assert "created, duration, status" in refused.text
        for sort, key in keys.items():
            newest_first = sorted(range(1, 121), key=lambda g: (*key(g), created(g), g))[::-1]
            for direction, expected in (("", newest_first), ("asc", newest_first[::-1])):
                first = f"/runs?workflow=paged&sort={sort}&dir={direction}"
                down, up = await asyncio.to_thread(pages, acme, first)
                every = [r for page in down for r in page]
                where = f"sort={sort} dir={direction or 'desc'}"
                assert every == [f"p-{g:03d}" for g in expected], where  # each once, in order
                assert [len(p) for p in down] == [50, 50, 20], where
                assert up == down[::-1], where  # back through the same pages
                assert set(as_of) == {sort == "duration"}, where
                as_of.clear()


def letter_of(driver: WebDriver, run: str) -> str:
    """The element id of the dead letter of ``run`` on the dead-letters page."""
    found = driver.find_element(By.XPATH, f"//section[.//a[text()='{run}']]")
    return str(found.get_attribute("id"))


async def test_mounted_in_a_host_app_the_inspector_takes_the_tenant_from_a_proxy_header(
    settings: Settings,
) -> None:
    """A deployment mounts the app in its own ASGI server behind a proxy that
    authenticates people and names their tenant in a header: links keep the mount's
    prefix, a request without the header is refused, another tenant's pages are not
    found, and the host's client serves the reads."""
    async with Worker.start(settings), AlmaClient(settings) as client:
        for tenant in ("acme", "beta"):
            ctx = WorkflowContext(tenant, WORKFLOW, None, f"{tenant}-mounted", "n")
            await client.applied(ctx, await client.node_completed(ctx, state={"t": tenant}))
        inspector_app = create_app(
            settings, tenant_header="X-Alma-Tenant", client=client, allowed_hosts=["host"]
        )
        host = Starlette(routes=[Mount("/inspect", inspector_app)])
        transport = httpx.ASGITransport(app=host)
        acme = {"X-Alma-Tenant": "acme"}
        async with httpx.AsyncClient(transport=transport, base_url="http://host") as http:
            missing = await http.get("/inspect/runs")
            assert missing.status_code == 403
            assert "X-Alma-Tenant header is missing" in missing.text
            listed = await http.get("/inspect/runs", headers=acme)
            assert listed.status_code == 200
            assert 'href="/inspect/run?tenant=acme&amp;id=acme-mounted"' in listed.text
            assert "beta-mounted" not in listed.text
            assert "default-src 'none'" in listed.headers["content-security-policy"]
            for other in ("/inspect/runs?tenant=beta", "/inspect/run?id=beta-mounted"):
                assert (await http.get(other, headers=acme)).status_code == 404
            assert (await http.get("/inspect/static/style.css")).status_code == 200
            # the tenant's page: its settings in effect, whose they are, what it holds
            await client.set_tenant_settings(
                "acme", learner=False, checkpoint_retention_days=7, storage_quota_bytes=1
            )
            page = await http.get("/inspect/tenant", headers=acme)
            assert page.status_code == 200
            rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>(\w+)</td></tr>", page.text)
            assert rows == [
                ("rate quota (events/s)", "no limit", "global"),
                ("burst (events)", "no limit", "global"),
                ("learner", "off", "own"),
                ("checkpoints of closed runs kept", "7 days", "own"),
                ("state size limit (bytes)", str(settings.max_state_bytes), "global"),
                ("storage quota (bytes of checkpoint states)", "1", "own"),
            ]
            used = (await client.tenant_storage("acme")).used
            assert used > 0
            assert f"{used} bytes of checkpoint states kept, {100 * used} % of its quota" in (
                page.text
            )
            assert "at its quota</strong>, its new runs are refused" in page.text
            assert "<th>runs</th><td>1 (1 open)</td>" in page.text
            assert "<th>checkpoints</th><td>1</td>" in page.text
            assert 'href="/inspect/tenant?tenant=acme"' in page.text  # in the navigation
            other = await http.get("/inspect/tenant?tenant=beta", headers=acme)
            assert other.status_code == 404
            # a NUL in a query: a page that says so (400, the CSP on it), never a 500
            nul = await http.get("/inspect/runs?q=a%00b", headers=acme)
            assert nul.status_code == 400
            assert "NUL character" in nul.text
            assert "default-src 'none'" in nul.headers["content-security-policy"]
            fork = await http.post(
                "/inspect/fork",
                headers={**acme, "origin": "http://host"},
                data={"id": "acme-mounted", "seq": "1", "new_run_id": "x"},
            )
            assert fork.status_code == 403  # writes are off
            # a name the deployment did not give is refused before any page is read
            other = await http.get("/inspect/runs", headers={**acme, "host": "rebound.test"})
            assert other.status_code == 400
            assert "answers to host, not to 'rebound.test'" in other.text
