"""The run inspector: a read-only web app over one tenant's runs (``alma ui``, or
:func:`create_app` mounted in a deployment's own ASGI server). Starlette and Jinja2
templates, no JavaScript needed. The routes are here and stay thin; what a page shows
is worked out by pure views of their own (:mod:`~alma_core.ui.views`,
:mod:`~alma_core.ui.graph`, :mod:`~alma_core.ui.gantt`, :mod:`~alma_core.ui.compare`),
rendered by :mod:`~alma_core.ui.rendering`, behind :mod:`~alma_core.ui.guards`; what an
address asks for is read and checked by :mod:`~alma_core.ui.params`.

Every page reads through what the SDK reads with: the tenant's
:class:`~alma_core.storage.reader.CheckpointReader` and
:class:`~alma_core.sdk.timeline.Timeline`, tenant-scoped SQL for lists, retrieval
under row-level security for memories. **Tenancy** (``guards.Access``): an inspector is
pinned to one tenant (``--tenant``), or takes each request's tenant from a header an
authenticating proxy sets (``tenant_header``), or (an operator's, with multi-tenant mode
off) lets the person pick; a request for another tenant's page is "not found".
**Safety**: templates escape everything; states and raw records are cut at
``views.SHOWN_CHARS`` and their control characters shown as escapes; a Content Security
Policy on every answer allows no script but the inspector's own; no page writes unless
writes are enabled, and then only a POST from the inspector's own origin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import asyncpg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from alma_core import errors, history
from alma_core.quotas import Quota
from alma_core.schemas import jsoncodec
from alma_core.schemas.decoder import Rejection
from alma_core.sdk import dead_letters as letters
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.timeline import Timeline
from alma_core.sequencing import SHOWN_STATUSES
from alma_core.settings import Settings
from alma_core.storage import dead_letters, retrieval, runs, tenant_settings
from alma_core.types import RetrievalScope, WorkflowContext
from alma_core.ui import compare, gantt, graph, params, rendering, views
from alma_core.ui.guards import Access, KnownHosts, SecurityHeaders

HERE = Path(__file__).parent
PAGE_SIZE = 50
EVENTS_PAGE = 100  # a run's history, per page
CHANGES_PAGE = 200  # a diff's changes, per page
STEPS_PAGE = 200  # of two runs' paths side by side
COUNT_CAP = 1000  # runs counted by status when searching by node or error text


def _url(path: str, **query: Any) -> str:
    kept = {k: v for k, v in query.items() if v not in (None, "")}
    return f"{path}?{urlencode(kept)}" if kept else path


class Inspector:
    """The pages, over one client's reads (and, with writes, its publishing)."""

    def __init__(
        self, settings: Settings, access: Access, client: AlmaClient, *, owns_client: bool
    ) -> None:
        self.settings = settings
        self.access = access
        self.client = client
        self.owns_client = owns_client  # its client is the inspector's own, to stop with it
        self.timeline = Timeline(client)
        self.env = rendering.environment()

    # -- plumbing -------------------------------------------------------------

    def page(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        context.setdefault("tenant", None)
        body = self.env.get_template(name).render(
            request=request,
            code=status,
            url=lambda path, **query: self.url(request, path, **query),
            writes=self.access.writes,
            pinned=self.access.tenant,
            **context,
        )
        return HTMLResponse(body, status_code=status)

    @staticmethod
    def url(request: Request, path: str, **query: Any) -> str:
        """A page's address under wherever the inspector is mounted."""
        return _url(str(request.scope.get("root_path", "")) + path, **query)

    def go(self, request: Request, path: str, **query: Any) -> Response:
        return RedirectResponse(self.url(request, path, **query), status_code=303)

    def tenant(self, request: Request) -> str:
        tenant = self.access.tenant_of(request)
        if tenant is None:
            raise HTTPException(
                400, "choose a tenant: add ?tenant=T (or start `alma ui --tenant T`)"
            )
        return tenant

    def tenant_shown(self, request: Request) -> str | None:
        """The tenant whose navigation an error page offers: the request's where it may
        see one, else the one the inspector is pinned to (None: no navigation)."""
        with contextlib.suppress(HTTPException):
            return self.access.tenant_of(request)
        return self.access.tenant

    async def pool(self) -> asyncpg.Pool:
        return await self.client.read_pool()

    def _ctx(self, tenant: str, run_id: str) -> WorkflowContext:
        return WorkflowContext(tenant_id=tenant, run_id=run_id)

    # -- pages ----------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        tenant = self.access.tenant_of(request)
        if tenant is not None:
            return self.go(request, "/runs", tenant=tenant)
        known = await runs.tenants(await self.pool())
        return self.page(request, "tenants.html", tenants=known)

    async def runs_page(self, request: Request) -> Response:
        tenant = self.tenant(request)
        q = request.query_params
        chosen = params.run_filter(tenant, q)
        at = params.listing(q, datetime.now(UTC))
        order, older_than, newer_than = at.order, at.older_than, at.newer_than
        # a search inside checkpoints counts up to COUNT_CAP runs (then says "more")
        inside = chosen.node is not None or chosen.error is not None
        async with runs.planned_for_values(await self.pool(), inside) as conn:
            listed = await runs.page(
                conn,
                chosen,
                before=older_than,
                newer_than=newer_than,
                limit=PAGE_SIZE + 1,
                order=order,
            )
            counts = await runs.status_counts(conn, chosen, cap=COUNT_CAP if inside else None)
        more = len(listed) > PAGE_SIZE
        if newer_than is not None:  # the page before: the oldest PAGE_SIZE of the newer
            listed = listed[-PAGE_SIZE:]
            more_older, more_newer = True, more
        else:
            listed = listed[:PAGE_SIZE]
            more_older, more_newer = more, older_than is not None
        after = before = None
        if listed and more_older:
            after = views.cursor(order.key(listed[-1]))
        if listed and more_newer:
            before = views.cursor(order.key(listed[0]))
        live = q.get("live") == "1"
        return self.page(
            request,
            "runs.html",
            tenant=tenant,
            runs=listed,
            counts=counts,
            total=sum(counts.values()),
            capped=inside and sum(counts.values()) > COUNT_CAP,
            cap=COUNT_CAP,
            statuses=SHOWN_STATUSES,
            query=at.query,
            order=order,
            after=after,
            newer=before,
            refresh=5 if live else None,
        )

    async def run_page(self, request: Request) -> Response:
        tenant = self.tenant(request)
        run_id = params.required(request.query_params, "id")
        pool = await self.pool()
        async with pool.acquire() as conn:
            report = await runs.report(conn, run_id, tenant)
            if not report:
                raise HTTPException(404, f"tenant {tenant!r} has no run {run_id!r}")
            run = report["run"]
            elsewhere, others = await runs.reached_elsewhere(
                conn, tenant, run["workflow_id"], run_id
            )
        completed = next((e for e in report["events"] if e["type"] == "workflow.completed"), None)
        completion = (
            {"at": completed["recorded_at"], "outcome": run["status"]} if completed else None
        )
        steps = views.steps(report["events"])
        drawn = graph.build(
            report["events"], report["checkpoints"], report["status"], elsewhere, others
        )
        timed = gantt.build(report["events"], now=datetime.now(UTC))
        laid_out = views.timeline(
            report["checkpoints"],
            report["joins"],
            report["dead_letters"],
            completion,
            link=self.url(request, "/checkpoint", tenant=tenant, id=run_id) + "&seq={seq}",
            took={s.event_id: s.took_ms for s in steps if s.took_ms is not None},
        )
        shown, events_page = self._paged(request, steps, "events", EVENTS_PAGE, "/run", id=run_id)
        async with pool.acquire() as conn:
            payloads = await runs.event_payloads(conn, tenant, run_id, [s.event_id for s in shown])
        outcome, fed = await retrieval.learned_from_run(pool, tenant, run_id)
        return self.page(
            request,
            "run.html",
            tenant=tenant,
            run=run,
            report=report,
            timeline=laid_out,
            graph=drawn,
            others_looked_at=others,
            gantt=timed,
            checkpoint_link=self.url(request, "/checkpoint", tenant=tenant, id=run_id) + "&seq=",
            outcome=outcome,
            fed=fed,
            seqs=[c["seq"] for c in report["checkpoints"]],
            failure=completed["error_message"] if completed else None,
            first_sent=steps[0].emitted_at if steps else None,
            steps=shown,
            payloads=payloads,
            events_page=events_page,
            refresh=3 if run["status"] == "running" and completed is None else None,
            run_status=report["status"],
        )

    async def checkpoint_page(self, request: Request) -> Response:
        tenant = self.tenant(request)
        run_id = params.required(request.query_params, "id")
        seq = params.integer(request.query_params, "seq")
        reader = await self.client.reader(tenant)
        cp = await reader.get(run_id, seq)
        if cp is None:
            raise HTTPException(404, f"run {run_id!r} of tenant {tenant!r} has no checkpoint {seq}")
        if cp.parent_seq:  # both again in one statement: of one projection
            both = await reader.get_many(run_id, [cp.parent_seq, seq])
            cp = both.get(seq, cp)
            before = both.get(cp.parent_seq or 0)
        else:
            before = None
        changes = history.diff(before.state if before else {}, cp.state)
        shown, changes_page = self._paged(
            request, changes, "changes", CHANGES_PAGE, "/checkpoint", id=run_id, seq=seq
        )
        # a state too big to show whole: its fields too, in natural order, a page at a
        # time, each a link away; a search keeps the fields whose name has the text
        searched = (request.query_params.get("key") or "").strip()
        fields, fields_page = self._paged(
            request,
            views.fields_in_order(cp.state, searched),
            "fields",
            CHANGES_PAGE,
            "/checkpoint",
            id=run_id,
            seq=seq,
            key=searched or None,
        )
        merge = None
        if cp.kind == "merge":
            merge = await self.timeline.merge(self._ctx(tenant, run_id), seq)
        return self.page(
            request,
            "checkpoint.html",
            tenant=tenant,
            run_id=run_id,
            cp=cp,
            before=before,
            merge=merge,
            before_seq=before.seq if before else None,
            after_seq=cp.seq,
            changes=shown,
            changes_page=changes_page,
            fields=fields,
            fields_page=fields_page,
            searched=searched,
        )

    async def checkpoint_json(self, request: Request) -> Response:
        """A checkpoint's whole state as JSON, as stored (the page cuts it), or the value
        at ``pointer`` (a JSON Pointer) in it: the address to copy, and where "more
        characters not shown" leads."""
        tenant = self.tenant(request)
        q = request.query_params
        run_id, seq = params.required(q, "id"), params.integer(q, "seq")
        cp = await (await self.client.reader(tenant)).get(run_id, seq)
        if cp is None:
            raise HTTPException(404, f"run {run_id!r} of tenant {tenant!r} has no checkpoint {seq}")
        pointer = request.query_params.get("pointer") or ""
        try:
            value = history.at_pointer(cp.state, pointer)
        except KeyError as exc:
            raise HTTPException(404, f"checkpoint {seq} of run {run_id!r}: {exc.args[0]}") from exc
        return Response(jsoncodec.compact(value), media_type="application/json")

    def _paged(
        self,
        request: Request,
        items: Sequence[Any],
        name: str,
        size: int,
        path: str,
        *,
        default: int = 0,
        **query: Any,
    ) -> tuple[list[Any], dict[str, Any]]:
        """One page of ``items`` (``?{name}=`` its start, clamped; ``default`` without
        one) and where the pages before and after it are (this page's address with
        another start, at the ``#{name}`` anchor): nothing on a page grows with a run (a
        10,000-key state's diff is 50 pages, not 2 MB of HTML)."""
        asked = params.whole(request.query_params.get(name) or str(default), name)
        start, previous, following = views.page_of(len(items), asked, size)
        tenant = self.tenant(request)

        def at(first: int | None) -> str | None:
            if first is None:
                return None
            return self.url(request, path, tenant=tenant, **query, **{name: first}) + f"#{name}"

        page = {
            "start": start,
            "total": len(items),
            "previous": at(previous),
            "next": at(following),
        }
        return list(items[start : start + size]), page

    async def diff_page(self, request: Request) -> Response:
        tenant = self.tenant(request)
        run_id = params.required(request.query_params, "id")
        a, b = params.integer(request.query_params, "a"), params.integer(request.query_params, "b")
        try:
            changes = await self.timeline.diff(self._ctx(tenant, run_id), a, b)
        except errors.ContextError as exc:
            raise HTTPException(404, exc.message) from exc
        shown, changes_page = self._paged(
            request, changes, "changes", CHANGES_PAGE, "/diff", id=run_id, a=a, b=b
        )
        return self.page(
            request,
            "diff.html",
            tenant=tenant,
            run_id=run_id,
            a=a,
            b=b,
            before_seq=a,
            after_seq=b,
            changes=shown,
            changes_page=changes_page,
        )

    async def compare_page(self, request: Request) -> Response:
        """Two runs of the tenant side by side (``id`` and ``with``): their paths, the
        first step where they part, and the diff of their states there."""
        tenant = self.tenant(request)
        q = request.query_params
        a_id, b_id = params.required(q, "id"), params.required(q, "with").strip()
        async with (await self.pool()).acquire() as conn:
            (a, a_from), (b, b_from) = [await runs.path(conn, tenant, r) for r in (a_id, b_id)]
        for rows, run_id in ((a, a_id), (b, b_id)):
            if not rows:
                raise HTTPException(
                    404, f"tenant {tenant!r} has no run {run_id!r} with checkpoints"
                )
        if a_from and a_from.get("run_id") == b_id:  # A is the fork: the source goes first
            return self.go(request, "/compare", tenant=tenant, id=b_id, **{"with": a_id})
        forked_at = b_from.get("seq") if b_from and b_from.get("run_id") == a_id else None
        compared = compare.compare(a, b, b_forked_at=forked_at)
        a_seq, b_seq = compared.seqs
        changes: list[history.Change] = []
        if a_seq is not None and b_seq is not None:
            reader = await self.client.reader(tenant)
            left, right = await reader.get(a_id, a_seq), await reader.get(b_id, b_seq)
            changes = history.diff(left.state if left else {}, right.state if right else {})
        where: dict[str, Any] = {"id": a_id, "with": b_id}
        shown, changes_page = self._paged(
            request, changes, "changes", CHANGES_PAGE, "/compare", **where
        )
        # the steps a page at a time, the first shown a few before the parting
        start = max(0, (compared.parted or 0) - 5)
        rows, steps_page = self._paged(
            request, compared.rows, "steps", STEPS_PAGE, "/compare", default=start, **where
        )
        return self.page(
            request,
            "compare.html",
            tenant=tenant,
            a=a_id,
            b=b_id,
            compared=compared,
            rows=rows,
            first_row=steps_page["start"],
            steps_page=steps_page,
            fork_of=forked_at is not None,
            run_id=None,
            before_seq=None,
            after_seq=None,
            changes=shown,
            changes_page=changes_page,
        )

    async def fork(self, request: Request) -> Response:
        tenant = self.tenant(request)
        self._may_write(request)
        form = await request.form()
        run_id, new_run = str(form.get("id") or ""), str(form.get("new_run_id") or "").strip()
        seq = params.whole(str(form.get("seq") or ""), "seq")
        if not (run_id and new_run):
            raise HTTPException(400, "a fork needs the run (id) and the new run's id (new_run_id)")
        patch_text = str(form.get("patch") or "").strip()
        try:
            patch = json.loads(patch_text) if patch_text else None
        except ValueError as exc:
            raise HTTPException(400, f"the JSON Patch is not JSON: {exc}") from None
        note = str(form.get("note") or "").strip() or None
        asked_by = str(form.get("asked_by") or "").strip() or None
        if (patch is not None or note) and asked_by is None:
            asked_by = "someone at the inspector"
        workflow = await (await self.client.reader(tenant)).workflow_of(run_id)
        ctx = WorkflowContext(tenant_id=tenant, workflow_id=workflow, run_id=run_id)
        try:
            await self.timeline.fork(
                ctx, seq, new_run, patch=patch, note=note, asked_by=asked_by, timeout=30.0
            )
        except errors.InvalidPatch as exc:
            raise HTTPException(400, exc.message) from exc
        except errors.AlmaError as exc:
            raise HTTPException(409, exc.message) from exc
        return self.go(request, "/run", tenant=tenant, id=new_run)

    async def dead_letters_page(self, request: Request) -> Response:
        tenant = self.tenant(request)
        q = request.query_params
        reason = q.get("reason") or None
        before = params.whole(q["before"], "before") if q.get("before") else None
        letter = params.whole(q["letter"], "letter") if q.get("letter") else None
        rows, reasons = await dead_letters.with_records(
            await self.pool(),
            tenant_id=tenant,
            reason=reason,
            limit=PAGE_SIZE + 1,
            head_bytes=views.SHOWN_CHARS,
            before=before,
            letter=letter,
        )
        older = rows[PAGE_SIZE - 1]["id"] if len(rows) > PAGE_SIZE else None
        rows = rows[:PAGE_SIZE]
        # a record the workers would refuse again as it is can only be sent again
        # corrected: no Replay button for it, and why (replay's own check; a record
        # longer than the page holds: replay says)
        checks = letters.ReplayChecks.of(self.settings)
        refused = {
            d["id"]: rejection.describe()
            for d in rows
            if d["replayed_at"] is None
            and d["value_head"] is not None
            and len(d["value_head"]) == d["value_bytes"]
            and isinstance(
                rejection := letters.as_sent(d["value_head"], tenant, checks)[1], Rejection
            )
        }
        return self.page(
            request,
            "dead_letters.html",
            refused=refused,
            tenant=tenant,
            letters=rows,
            reasons=reasons,
            reason=reason,
            replayed=q.get("replayed"),
            older=older,
            paged=before is not None or letter is not None,
        )

    async def replay_letter(self, request: Request) -> Response:
        tenant = self.tenant(request)
        self._may_write(request)
        letter = params.whole(request.path_params["letter"], "letter")
        async with (await self.pool()).acquire() as conn:
            try:
                await letters.replay(
                    conn,
                    self.client.publish_record,
                    letter,
                    letters.ReplayChecks.of(self.settings),
                    tenant_id=tenant,
                )
            except errors.AlmaError as exc:
                raise HTTPException(409, exc.message) from exc
        return self.go(request, "/dead-letters", tenant=tenant, replayed=letter)

    async def tenant_page(self, request: Request) -> Response:
        """The tenant's settings in effect (its own where set, else the global ones), what
        it holds in PostgreSQL now and its kept bytes against its storage quota."""
        tenant = self.tenant(request)
        pool = await self.pool()
        own = await tenant_settings.load(pool, tenant)
        s = self.settings
        return self.page(
            request,
            "tenant.html",
            tenant=tenant,
            own=own,
            quota=own.quota(Quota(s.tenant_rate, s.tenant_burst)),
            retention_days=own.retention_days(s.checkpoint_retention_days),
            state_limit=own.state_limit(s.max_state_bytes),
            used=await tenant_settings.usage(pool, tenant),
            held=await tenant_settings.standing(pool, tenant, s.tenant_storage_quota_bytes),
        )

    async def memory_page(self, request: Request) -> Response:
        tenant = self.tenant(request)
        q = request.query_params
        task = (q.get("task") or "").strip()
        scope_name = (q.get("scope") or "tenant").upper()
        if scope_name not in RetrievalScope.__members__ or scope_name == "GLOBAL":
            raise HTTPException(400, f"no scope {scope_name.lower()!r} here")
        top_k = params.whole(q.get("top_k") or "5", "top_k")
        if not 1 <= top_k <= 50:
            raise HTTPException(400, f"top_k: {top_k} is not from 1 to 50 (items of each kind)")
        found = None
        took_ms = 0.0
        if task:
            ctx = WorkflowContext(
                tenant_id=tenant,
                workflow_id=q.get("workflow") or None,
                run_id=q.get("run") or None,
                node_id=q.get("node") or None,
            )
            started = time.perf_counter()
            try:
                found = await self.client.retrieve(
                    task,
                    ctx,
                    RetrievalScope[scope_name],
                    agent=q.get("agent") or None,
                    top_k=top_k,
                )
            except errors.ContextError as exc:
                raise HTTPException(400, exc.message) from exc
            took_ms = (time.perf_counter() - started) * 1000
        doc = found.to_doc() if found else None
        return self.page(
            request,
            "memory.html",
            tenant=tenant,
            query=dict(q),
            scopes=[s.value for s in RetrievalScope if s is not RetrievalScope.GLOBAL],
            found=doc,
            rows=views.memory_rows(doc["items"]) if doc else [],
            top_k=top_k,
            took_ms=took_ms,
        )

    # -- writes ---------------------------------------------------------------

    def _may_write(self, request: Request) -> None:
        """Writes are enabled, and the form came from this inspector's own pages (a
        page of another site cannot make a person's browser fork or replay)."""
        if not self.access.writes:
            raise HTTPException(
                403, "writes are off: start `alma ui --allow-writes` to fork or replay"
            )
        # the Host was checked against the allowed names (KnownHosts): the page that
        # posted must be of that same origin
        origin = urlsplit(request.headers.get("origin") or request.headers.get("referer") or "")
        own = (request.url.scheme, request.headers.get("host"))
        if (origin.scheme, origin.netloc) != own:  # https://host is not http://host's page
            raise HTTPException(403, "a write must come from the inspector's own pages")

    async def close(self) -> None:
        if self.owns_client:
            await self.client.stop()


def create_app(
    settings: Settings,
    *,
    tenant: str | None = None,
    tenant_header: str | None = None,
    allow_writes: bool = False,
    client: AlmaClient | None = None,
    allowed_hosts: Sequence[str] = views.LOOPBACK_HOSTS,
) -> Starlette:
    """The inspector as an ASGI app. In multi-tenant mode it must be pinned to a tenant
    or given the header that names each request's tenant. It answers only requests
    addressed to ``allowed_hosts`` (loopback by default; ``*.example.com`` for a
    domain's names, ``*`` for any, where a proxy in front checks the name)."""
    if not allowed_hosts:
        raise errors.ConfigError("the inspector needs at least one allowed host name")
    if settings.require_tenant and not (tenant or tenant_header):
        raise errors.ConfigError(
            "the inspector shows one tenant's runs in multi-tenant mode "
            "(ALMA_REQUIRE_TENANT=true): pass --tenant T, or --tenant-header H where a "
            "proxy that authenticates people names their tenant"
        )
    access = Access(tenant, tenant_header, allow_writes)
    holder: dict[str, Inspector] = {}
    opening = asyncio.Lock()

    async def inspector() -> Inspector:
        """Built on first use (a mounted app's lifespan is its host's): over ``client``
        (the host's, which it starts and stops), or a client of its own."""
        async with opening:
            if "it" not in holder:
                own = client or AlmaClient(settings)
                if client is None and allow_writes:
                    await own.start()  # forks and replays publish through it
                holder["it"] = Inspector(settings, access, own, owns_client=client is None)
        return holder["it"]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await inspector()  # a service that cannot start says so now, not at a page
        yield
        await holder["it"].close()

    def handler(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            started = time.perf_counter()
            it = await inspector()
            try:
                if any("\x00" in k or "\x00" in v for k, v in request.query_params.multi_items()):
                    # PostgreSQL's text cannot hold one: refused here, not a 500 later
                    raise HTTPException(400, "a query parameter holds a NUL character (%00)")
                response: Response = await getattr(it, name)(request)
            except HTTPException as exc:
                response = it.page(
                    request,
                    "error.html",
                    status=exc.status_code,
                    message=exc.detail,
                    tenant=it.tenant_shown(request),
                )
            except errors.StorageError as exc:
                response = it.page(
                    request,
                    "error.html",
                    status=503,
                    message=exc.message,
                    tenant=it.tenant_shown(request),
                )
            ms = (time.perf_counter() - started) * 1000
            response.headers["Server-Timing"] = f"app;dur={math.floor(ms * 10) / 10}"
            return response

        return handle

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(
        routes=[
            Route("/", handler("home")),
            Route("/runs", handler("runs_page")),
            Route("/run", handler("run_page")),
            Route("/checkpoint", handler("checkpoint_page")),
            Route("/checkpoint.json", handler("checkpoint_json")),
            Route("/diff", handler("diff_page")),
            Route("/compare", handler("compare_page")),
            Route("/fork", handler("fork"), methods=["POST"]),
            Route("/dead-letters", handler("dead_letters_page")),
            Route("/dead-letters/{letter}/replay", handler("replay_letter"), methods=["POST"]),
            Route("/memory", handler("memory_page")),
            Route("/tenant", handler("tenant_page")),
            Route("/healthz", healthz),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        lifespan=lifespan,
        middleware=[Middleware(SecurityHeaders), Middleware(KnownHosts, allowed=allowed_hosts)],
    )
