"""Server-sent events: a task's events (from `app.core.follow`) as a `text/event-stream`."""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from app.core.follow import Events, event_text


def frame(event: dict[str, Any]) -> bytes:
    return f"id: {event['sequence_number']}\nevent: {event['type']}\ndata: {event_text(event)}\n\n".encode()


async def start(request: web.Request, status: int = 200, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """An SSE response, its headers sent (X-Accel-Buffering: a proxy in front must not hold events back)."""
    response = web.StreamResponse(status=status, headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", **(headers or {})})
    await response.prepare(request)
    return response


async def send(request: web.Request, events: Events, status: int = 200,
               headers: dict[str, str] | None = None) -> web.StreamResponse:
    """`events` (from `follow`) as an SSE stream."""
    response = await start(request, status, headers)
    async with contextlib.aclosing(events):
        async for event in events:
            # A heartbeat is a lone comment line, no blank line after it: see LMSP §6 on the openai SDK.
            await response.write(frame(event) if event is not None else b": keep-alive\n")
    return response
