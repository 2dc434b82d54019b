"""Who may see and do what in the run inspector, and what every answer carries: the
request's tenant (:class:`Access`), the host names it answers to (:class:`KnownHosts`,
against DNS rebinding) and the security headers on every response
(:class:`SecurityHeaders`: the Content-Security-Policy, ``nosniff``, the referrer
policy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alma_core.ui import views

CSP = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self'; "
    "img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)


@dataclass(frozen=True)
class Access:
    """Whose pages a request may see, and whether it may write."""

    tenant: str | None = None  # pinned: this tenant's pages only
    tenant_header: str | None = None  # a trusted proxy names each request's tenant here
    writes: bool = False  # fork and dead-letter replay (POST, same origin only)

    def tenant_of(self, request: Request) -> str | None:
        """The request's tenant; None: the person is to pick one (an operator's
        inspector). Another tenant than the one allowed: not found."""
        asked = request.query_params.get("tenant") or None
        allowed = self.tenant
        if self.tenant_header:
            allowed = request.headers.get(self.tenant_header)
            if not allowed:
                raise HTTPException(403, f"no tenant: the {self.tenant_header} header is missing")
        if allowed is not None and asked not in (None, allowed):
            raise HTTPException(404, f"no tenant {asked!r} here")
        return allowed or asked


HEADERS = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
)


class SecurityHeaders:
    """Every response the inspector sends carries its Content-Security-Policy,
    ``nosniff`` and its referrer policy: pages, errors, Starlette's own 404 and 405, the
    static files and the refusals of :class:`KnownHosts`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                given = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in HEADERS if k not in given]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)


class KnownHosts:
    """Answer only requests addressed to one of the inspector's host names (the
    ``Host`` header): a page of another site whose name resolves to this address (DNS
    rebinding) is refused before it reads anything. Not Starlette's
    TrustedHostMiddleware: it cuts the port at the first colon, so ``[::1]:8765``
    never matches."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = tuple(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = Headers(scope=scope).get("host", "")
            if not views.host_allowed(host, self.allowed):
                refused = PlainTextResponse(
                    f"this inspector answers to {', '.join(self.allowed)}, not to "
                    f"{views.visible(host[:100])!r}. Open it by one of those names; whoever "
                    "runs it adds a name with `alma ui --allowed-host NAME`",
                    status_code=400,
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)
