"""The run inspector's answers as a browser or a script receives them (no browser
needed here): every response carries its security headers (404, 405, static files and
refused hosts too), a write must come from the inspector's own origin, scheme included,
an error page keeps the navigation, a dead letter today's decoder refuses as it is
offers no Replay button, counts read "1 run", a memory count out of range is refused,
two runs are compared (a fork beside its source, parted where it was edited), and the
copyable command for a run id with a bidirectional control shows none and, pasted into
bash, finds the run. On the real stack: the broker, PostgreSQL, Redis and
a worker."""

from __future__ import annotations

import asyncio
import html
import json
import re
import shlex
import shutil
import subprocess
import sys

import httpx

from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from alma_core.ui import create_app
from tests.integration.harness import Publisher, Worker, count, event, wait_for, worker_env
from tests.integration.test_cli import alma

HOSTILE_RUN = "invoice\u202egpj.exe"  # reads "invoiceexe.jpg" where shown raw


def pasted(command: str, settings: Settings) -> subprocess.CompletedProcess[str]:
    """``command`` as a person pastes it into bash (``alma`` being this checkout's)."""
    bash = shutil.which("bash")
    assert bash
    env = worker_env(settings) | {"LC_ALL": "C.UTF-8"}
    alma_here = f"{shlex.quote(sys.executable)} -m alma_core.cli"
    script = f'alma() {{ {alma_here} "$@"; }}; {command} --json'
    return subprocess.run(
        [bash, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False
    )


async def test_the_inspectors_answers_hold_their_headers_origin_and_words(
    settings: Settings,
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    async with AlmaClient(settings) as client, Worker.start(settings):
        ctx = WorkflowContext("acme", "wf", None, HOSTILE_RUN, "plan")
        await client.node_completed(ctx, state={"a": 1}, wait="applied", timeout=60)
        nul = event("node.completed", "nul-run", node="has\x00nul", state={"a": 1})
        async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
            await pub.send(json.dumps(nul).encode(), key=b"nul-run")
            await pub.flush()

        async def lettered() -> bool:
            return await count(dsn, "SELECT count(*) FROM dead_letters") == 1

        await wait_for(lettered, what="the NUL record's dead letter")

        app = create_app(settings, tenant="acme", allow_writes=True, client=client)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            # the security headers on every answer, not only on the pages
            answers = {
                "a page": await http.get("/runs"),
                "404": await http.get("/nowhere"),
                "405": await http.post("/runs"),
                "a static file": await http.get("/static/style.css"),
                "a refused host": await http.get("/runs", headers={"host": "evil.test"}),
            }
            assert [a.status_code for a in answers.values()] == [200, 404, 405, 200, 400]
            for what, answer in answers.items():
                assert "default-src 'none'" in answer.headers["content-security-policy"], what
                assert answer.headers["x-content-type-options"] == "nosniff", what
                assert answer.headers["referrer-policy"] == "same-origin", what
            # one run, counted as such
            assert "1 run ·" in answers["a page"].text

            # the run's copyable command: no raw control character, and bash finds the run
            page = (await http.get("/run", params={"id": HOSTILE_RUN})).text
            assert "\u202e" not in page
            found = re.search(r'<code id="run-cli">([^<]+)</code>', page)
            assert found
            command = html.unescape(found.group(1))
            assert command == "alma runs show $'invoice\\u202egpj.exe' --tenant acme"
            shown = await asyncio.to_thread(pasted, command, settings)
            assert shown.returncode == 0, shown.stderr
            assert json.loads(shown.stdout)["run"]["run_id"] == HOSTILE_RUN

            # an error page keeps the navigation
            missing = await http.get("/run", params={"id": "no-such-run"})
            assert missing.status_code == 404
            assert '<a href="/runs?tenant=acme">Runs</a>' in missing.text

            # a write from a page of another scheme (https://127.0.0.1) is another origin's
            fork = {"id": HOSTILE_RUN, "seq": "1", "new_run_id": "forked-1"}
            for origin in ("https://127.0.0.1", "http://127.0.0.1:8765", "http://evil.test"):
                refused = await http.post("/fork", data=fork, headers={"origin": origin})
                assert refused.status_code == 403, origin
                assert "own pages" in refused.text
            own = {"origin": "http://127.0.0.1"}
            done = await http.post("/fork", data=fork, headers=own)
            assert done.status_code == 303
            # edit, then fork: the patch applied, who and why shown on the new run
            edit = {
                "id": HOSTILE_RUN,
                "seq": "1",
                "new_run_id": "edited-1",
                "patch": '[{"op": "replace", "path": "/a", "value": 2}]',
                "note": "a bigger a",
                "asked_by": "ana",
            }
            assert (await http.post("/fork", data=edit, headers=own)).status_code == 303
            edited = (await http.get("/run", params={"id": "edited-1"})).text
            assert "a JSON Patch of 1 operation " in edited
            assert "why: a bigger a · asked by ana" in edited
            latest = (await client.resume(WorkflowContext("acme", "wf", None, "edited-1"))).latest
            assert latest is not None
            assert latest.state == {"a": 2}
            # and on the source's page, its forks, newest first, each with why and who
            source = html.unescape((await http.get("/run", params={"id": HOSTILE_RUN})).text)
            listed = re.findall(r'<a class="fork" href="[^"]+">([^<]+)</a>', source)
            assert listed == ["edited-1", "forked-1"]
            assert "from seq 1, " in source
            assert 'its state edited <span class="note">why: a bigger a · asked by ana' in source
            # the two runs compared: the fork aligned with its source, parted by the edit
            compared = await http.get("/compare", params={"id": HOSTILE_RUN, "with": "edited-1"})
            assert compared.status_code == 200
            read = html.unescape(compared.text)
            assert "a fork of A taken at A's seq 1" in read
            assert "They part at step 1: B began from A's seq 1 with another state" in read
            assert 'id="first-difference"' in compared.text
            change = re.search(
                r'<tr class="changed"><td class="path"><code>/a</code>', compared.text
            )
            assert change, "the diff of their states where they part"
            unedited = await http.get("/compare", params={"id": HOSTILE_RUN, "with": "forked-1"})
            assert "The same path" in unedited.text
            swapped = await http.get("/compare", params={"id": "edited-1", "with": HOSTILE_RUN})
            assert swapped.status_code == 303  # the source goes first
            assert "with=edited-1" in swapped.headers["location"]
            nowhere = await http.get("/compare", params={"id": HOSTILE_RUN, "with": "nowhere"})
            assert nowhere.status_code == 404
            for patch, says in (
                ('[{"op": "remove", "path": "/b"}]', "does not apply"),
                ("[{not json", "is not JSON"),
            ):
                bad = await http.post(
                    "/fork", data=edit | {"new_run_id": "never-1", "patch": patch}, headers=own
                )
                assert bad.status_code == 400, patch
                assert says in bad.text

            # a record today's decoder refuses as it is offers no Replay button, says why
            letters = (await http.get("/dead-letters")).text
            assert 'class="replay"' not in letters
            assert "Not replayable as it is" in letters
            assert "--value-file FILE --tenant acme</code>" in letters

            # memory: a count of items out of 1..50 is refused, not shown as "up to -1"
            for top_k in ("-1", "0", "51"):
                bad = await http.get("/memory", params={"task": "t", "top_k": top_k})
                assert bad.status_code == 400, top_k
                assert f"top_k: {top_k} is not from 1 to 50" in bad.text

            # the tenant page says why its two sizes differ
            tenant = (await http.get("/tenant")).text
            assert 'id="stored-note"' in tenant
            assert "as it was written" in tenant

            # a state of 2,000 fields: in natural order, searched by name in any case
            wide = {f"step{i}": i for i in range(1, 2001)} | {"Alpha": 0}
            big = WorkflowContext("acme", "wf", None, "wide-1", "plan")
            await client.node_completed(big, state=wide, wait="applied", timeout=60)

            def fields(page: httpx.Response) -> list[str]:
                assert page.status_code == 200, page.text
                table = page.text.partition('id="state-fields"')[2].partition("</table>")[0]
                cells = re.findall(r'<td class="path"><code>([^<]+)</code>', table)
                return [html.unescape(c) for c in cells]

            shown = await http.get("/checkpoint", params={"id": "wide-1", "seq": "1"})
            assert fields(shown)[:12] == ["Alpha", *(f"step{i}" for i in range(1, 12))]
            found = await http.get(
                "/checkpoint", params={"id": "wide-1", "seq": "1", "key": "STEP1"}
            )
            # step1, step10-19, step100-199, step1000-1999: by number, 200 a page
            assert fields(found)[:12] == ["step1", *(f"step{i}" for i in range(10, 20)), "step100"]
            assert len(fields(found)) == 200
            assert "1111 fields whose name contains “STEP1” (any case)" in found.text
            later = re.search(r'id="fields-later" href="([^"]+)"', found.text)
            assert later
            assert "key=STEP1" in html.unescape(later.group(1))  # the search kept
            after = await http.get(html.unescape(later.group(1)).split("#")[0])
            assert fields(after)[0] == "step1089"  # after step1-19, step100-199, step1000-1088
            none = await http.get("/checkpoint", params={"id": "wide-1", "seq": "1", "key": "zz"})
            assert fields(none) == []
            assert "0 fields whose name contains “zz”" in none.text

    # the CLI shows the id with its escape, never the raw control character
    printed = await asyncio.to_thread(
        alma, "runs", "show", HOSTILE_RUN, "--tenant", "acme", env=worker_env(settings)
    )
    assert printed.returncode == 0, printed.stderr
    assert "\u202e" not in printed.stdout
    assert "invoice\\u202egpj.exe" in printed.stdout
