"""Remote endpoints (LMSP §11): models that run on other OpenAI-compatible servers.

`Upstreams` keeps, in memory, each remote model's endpoints with their API keys (read from the
vault, never the database), their health and how many tasks each runs. A `RemoteEngine` runs
one task: it sends the request to the reachable endpoint with the fewest running tasks, moves
on to the next when a connection fails before the stream starts, waits (the task stays
`loading`) while none answers, and streams the upstream's deltas to the runner in the same
messages a local engine sends. An upstream that breaks mid-stream hands the task to another
endpoint, which continues the text where it can (llama.cpp's llama-server) and otherwise starts
it again: OpenAI-compatible servers cannot be trusted to continue a half-written assistant
message, so the runner resets the output (`resume_mode: retry`). What it sends and reads back,
request bodies and stream chunks, is in wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx2

from app.engine.net.wire import Reader, chat_request, read_chat, read_completion, sampling
from app.engine.request import Request
from app.engine.runs import EngineError, Generation, Message, Waiting
from app.logs import redact

log = logging.getLogger(__name__)
CONNECT_SECONDS = 5.0      # to open a connection or answer a probe
STALL_SECONDS = 300.0      # the longest silence inside a stream before the upstream counts as gone
WAIT_FIRST, WAIT_LAST = 0.5, 10.0  # seconds between rounds of tries while no endpoint answers
QUOTED_CHARS = 1000        # of what an upstream says, in an error message


class RemoteError(Exception):
    """Why an endpoint cannot be used, as an LMSP error code and a message that names it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class Endpoint:
    """One upstream of a remote model, as routing sees it."""
    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)  # memory only
    key_ref: str | None = None  # the name of the secret holding `api_key`
    continues: bool | None = None  # it can continue a half-written answer (llama-server); None: not probed
    status: str = "available"   # available | unreachable
    error: str | None = None    # why it is unreachable
    running: int = 0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def quote(self, text: str) -> str:
        """What the upstream said, without its key: some proxies and debug servers echo the request's
        `Authorization` header in their errors, and these words reach the app and the database."""
        if self.api_key:
            text = text.replace(self.api_key, "[redacted]")
        return redact(text)[:QUOTED_CHARS]  # cut after redacting: a cut key would escape it

    def mark(self, error: RemoteError | None) -> None:
        if error is None:
            if self.status != "available":
                log.info("upstream %s answers again", self.base_url)
            self.status, self.error = "available", None
        else:
            if self.status != "unreachable":
                log.warning("%s", error.message)  # it names the endpoint
            self.status, self.error = "unreachable", error.message

    def describe(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model": self.model, "has_api_key": bool(self.api_key),
                "status": self.status, "error": self.error, "running": self.running}


def check_url(base_url: Any) -> str:
    """The base URL if it is one an upstream can have (http or https, a host); else RemoteError."""
    if not isinstance(base_url, str) or not base_url.strip():
        raise RemoteError("invalid_url", "`base_url` is required, e.g. http://gpu-box:8080/v1.")
    parts = urlsplit(base_url.strip())
    if parts.username is not None or parts.password is not None:  # not echoed: it holds a password
        raise RemoteError("invalid_url", "A base URL cannot carry a user name or password (user:password@host): "
                          "every app that lists models would see it. Put the key in `api_key`.")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError("invalid_url", f"{base_url!r} is not an http:// or https:// URL with a host.")
    if parts.query or parts.fragment:
        raise RemoteError("invalid_url", f"{base_url!r}: a base URL has no query or fragment.")
    return base_url.strip().rstrip("/")


def transport_error(endpoint: Endpoint, exc: Exception) -> RemoteError:
    """What a failed connection means, in words that say what to fix."""
    where = endpoint.base_url
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return RemoteError("upstream_tls_error", f"{where}: the TLS handshake failed ({cause.__class__.__name__}: "
                               f"{getattr(cause, 'reason', None) or cause}).")
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx2.TimeoutException):
        return RemoteError("upstream_unreachable", f"{where} did not answer within {CONNECT_SECONDS:.0f} s.")
    if isinstance(exc, httpx2.ConnectError):
        return RemoteError("upstream_unreachable", f"{where} refused the connection or cannot be reached ({exc}).")
    return RemoteError("upstream_unreachable", f"{where}: the connection failed ({exc.__class__.__name__}: {exc}).")


def error_text(body: Any) -> str:
    """The message of an error an upstream sent, in an answer or inside its stream (OpenAI's
    `{"error": {"message"}}`, FastAPI's `detail`), or what it sent instead."""
    error = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return error if isinstance(error, str) else json.dumps(error)


def upstream_message(endpoint: Endpoint, response: httpx2.Response) -> str:
    """The error message of an upstream's answer, without the endpoint's key."""
    try:
        return endpoint.quote(error_text(response.json()))
    except ValueError:
        return endpoint.quote(response.text or response.reason_phrase)


async def probe(client: httpx2.AsyncClient, endpoint: Endpoint) -> list[str]:
    """`GET {base_url}/models`: the model names it serves. Raises RemoteError saying what is wrong:
    an unreachable or TLS-failing server, a refused key, an answer that is not OpenAI's, or a model
    it does not serve."""
    try:
        response = await client.get(endpoint.url("/models"), headers=endpoint.headers(), timeout=CONNECT_SECONDS)
    except httpx2.TransportError as exc:
        raise transport_error(endpoint, exc) from None
    where = endpoint.base_url
    if response.status_code in (401, 403):
        raise RemoteError("upstream_auth_failed", f"{where} refused the API key ({response.status_code}: "
                          f"{upstream_message(endpoint, response)}).")
    try:
        listed: Any = response.json()["data"] if response.status_code == 200 else None  # JSON: checked below
        names = [m["id"] for m in listed] if isinstance(listed, list) else None
    except (ValueError, KeyError, TypeError):
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise RemoteError("upstream_not_openai", f"{where}/models did not answer as an OpenAI-compatible server "
                          f"does (HTTP {response.status_code}; expected a JSON list of models). Is the base URL "
                          "the one that ends in /v1?")
    # llama-server says it is one; it alone has the endpoints a continuation needs.
    endpoint.continues = any(isinstance(m, dict) and m.get("owned_by") == "llamacpp" for m in listed)
    if names and endpoint.model not in names:
        raise RemoteError("upstream_model_not_found", f"{where} does not serve a model {endpoint.model!r}; it "
                          f"serves: {', '.join(names[:20])}.")
    return names


class Upstreams:
    """Every remote model's endpoints, their health and load; one HTTP client for all."""

    def __init__(self) -> None:
        self.models: dict[str, list[Endpoint]] = {}
        self.wait_seconds = 300.0  # setting remote_wait_seconds
        self._client: httpx2.AsyncClient | None = None

    @property
    def client(self) -> httpx2.AsyncClient:
        if self._client is None:
            # No pool limit: concurrency is bounded by max_concurrent_remote_tasks, not here.
            self._client = httpx2.AsyncClient(timeout=httpx2.Timeout(STALL_SECONDS, connect=CONNECT_SECONDS),
                                              limits=httpx2.Limits(max_connections=None))
        return self._client

    def set(self, model_id: str, endpoints: list[Endpoint]) -> None:
        """Take a model's endpoints as they now are. An endpoint that stays (same URL and model) stays
        the same object, with its new key and health: the tasks running on it count there."""
        known = {(e.base_url, e.model): e for e in self.models.get(model_id, [])}
        kept = []
        for new in endpoints:
            old = known.get((new.base_url, new.model))
            if old is not None:
                old.api_key, old.key_ref, old.status, old.error = new.api_key, new.key_ref, new.status, new.error
                old.continues = new.continues
            kept.append(old or new)
        self.models[model_id] = kept

    def forget(self, model_id: str) -> None:
        self.models.pop(model_id, None)

    def order(self, model_id: str) -> list[Endpoint]:
        """The endpoints to try: reachable ones first, fewest running tasks first, then as listed."""
        endpoints = self.models.get(model_id, [])
        return sorted(endpoints, key=lambda e: (e.status != "available", e.running, endpoints.index(e)))

    def describe(self, model_id: str) -> list[dict[str, Any]]:
        return [e.describe() for e in self.models.get(model_id, [])]

    async def check(self) -> None:
        """Probe every endpoint of a server no task is using, so that the health shown is current.
        A busy server is left alone: llama_cpp.server ends the stream it runs for any new request."""
        endpoints = [e for listed in self.models.values() for e in listed]
        busy = {e.base_url for e in endpoints if e.running}
        idle = [e for e in endpoints if e.base_url not in busy]
        await asyncio.gather(*(self._check(e) for e in idle))

    async def _check(self, endpoint: Endpoint) -> None:
        try:
            await probe(self.client, endpoint)
            endpoint.mark(None)
        except RemoteError as exc:
            endpoint.mark(exc)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class RemoteEngine:
    """Runs one task on a remote model's endpoints (the runner makes one per task).

    A task that already has output (resumed after a restart, or moved off an endpoint that
    broke) continues it where the endpoint can: llama.cpp's `llama-server` evaluates the chat
    template's prompt followed by the text so far (`/apply-template`, then `/completion`), as if
    it had written that text itself. Elsewhere the output starts again (`reset`).

    Each try at an endpoint is one task (`_stream`) that sends the request, reads the stream
    and closes it: the HTTP client's connection is opened and closed in the same task, and a
    cancel is that task's cancellation, which closes the connection and so stops the upstream."""

    def __init__(self, upstreams: Upstreams) -> None:
        self.upstreams = upstreams
        self.model_id = ""
        self.name = "remote"
        self.gen = Generation(Request([]), None)
        self.text = ""          # the output so far, committed or streamed
        self.tokens = 0
        self._endpoint: Endpoint | None = None  # the endpoint streaming, and its stream's messages
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._restart = False   # the stream opened starts the output again
        self._cancelled = asyncio.Event()

    async def open(self, model: Any, gen: Generation, waiting: Waiting) -> bool:
        """Start `gen` on a reachable endpoint; while none answers, tell `waiting` and try again,
        up to the setting remote_wait_seconds. Raises EngineError (`upstream_unavailable`, or
        `upstream_error` when the upstreams refused the request itself)."""
        self.model_id, self.name = model["id"], f"remote:{model['id']}"
        self.gen, self.text, self.tokens = gen, gen.prefix_text, gen.prefix_tokens
        deadline = time.monotonic() + self.upstreams.wait_seconds  # counted from the first try
        pause = WAIT_FIRST
        while not self._cancelled.is_set():
            errors = await self._connect()
            if self._endpoint is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError("upstream_unavailable", f"No endpoint of {self.model_id!r} answered for "
                                  f"{self.upstreams.wait_seconds:.0f} s (setting remote_wait_seconds): "
                                  + " ".join(errors))
            await waiting("Waiting for an endpoint to answer: " + " ".join(errors))
            with contextlib.suppress(asyncio.TimeoutError):  # a cancel ends the pause at once
                # The last pause ends at the deadline, and one more try is made there: never sooner.
                await asyncio.wait_for(self._cancelled.wait(), min(pause, left))
            pause = min(pause * 2, WAIT_LAST)
        return False

    async def _connect(self) -> list[str]:
        """Send the task to each endpoint in routing order until one starts a stream; the errors
        of those that did not. An upstream's 4xx fails the task: another would refuse it too; so
        does a 5xx from every endpoint (they answer: waiting for them would not help)."""
        errors: list[str] = []
        answered: list[str] = []
        for endpoint in self.upstreams.order(self.model_id):
            endpoint.running += 1  # counted from the start: tasks opening at once spread out
            self._endpoint, self._queue = endpoint, asyncio.Queue()
            self._pump = asyncio.create_task(self._stream(endpoint, self._queue), name=f"lmsp-{self.name}")
            first = await self._queue.get()
            if first["ev"] == "opened":
                log.info("%s: streaming from %s%s", self.name, endpoint.base_url,
                         " (continuing its text)" if self.text and not self._restart else "")
                return errors
            self._release()
            if first["ev"] == "done":  # cancelled meanwhile
                return errors
            if first["ev"] == "refused" and first["status"] < 500:
                raise EngineError("upstream_error", first["message"])
            errors.append(first["message"])
            if first["ev"] == "refused":
                answered.append(first["message"])
        if answered and len(answered) == len(errors):
            raise EngineError("upstream_error", " ".join(answered))
        if not errors:
            errors.append(f"The model {self.model_id!r} has no endpoints.")
        return errors

    async def _request(self, endpoint: Endpoint) -> tuple[str, dict[str, Any], Reader]:
        """Where and what to send to carry on the task on `endpoint`, and how to read its stream:
        a continuation of the text so far where it can, else the chat completion from the start."""
        client = self.upstreams.client
        if self.text and endpoint.continues is None:  # not probed since the service started
            await probe(client, endpoint)
        continuing = bool(self.text) and bool(endpoint.continues)
        self._restart = bool(self.text) and not continuing
        if not continuing:
            return endpoint.url("/chat/completions"), chat_request(endpoint.model, self.gen), read_chat
        root = endpoint.base_url.removesuffix("/v1")
        rendered = await client.post(root + "/apply-template", headers=endpoint.headers(), timeout=CONNECT_SECONDS,
                                     json={"messages": self.gen.request.prompt()})
        rendered.raise_for_status()
        body = {"prompt": rendered.json()["prompt"] + self.text, "cache_prompt": True, **sampling(self.gen.request)}
        if self.gen.max_tokens is not None:
            body["n_predict"] = max(1, self.gen.max_tokens - self.tokens)
        return root + "/completion", body, read_completion

    async def _stream(self, endpoint: Endpoint, queue: asyncio.Queue[Message]) -> None:
        """One try at `endpoint`, as messages on `queue`: `opened` or why not (`failed`: no
        answer, `refused`: an HTTP error), then the chunks, ending with `done`, `broken` (the
        stream failed) or `error` (the upstream sent one)."""
        reason: str | None = None
        usage: dict[str, Any] = {}
        opened = False
        try:
            url, body, reader = await self._request(endpoint)
            async with self.upstreams.client.stream("POST", url, headers=endpoint.headers(), json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    said = upstream_message(endpoint, response)
                    queue.put_nowait({"ev": "refused", "status": response.status_code,
                                      "message": f"{endpoint.base_url} answered {response.status_code}: {said}"})
                    return
                endpoint.mark(None)
                queue.put_nowait({"ev": "opened"})
                opened = True
                sent_error: str | None = None
                # Read to the end, never left early: an async generator of the HTTP stack left
                # suspended would be closed later, outside this task, and break its locks.
                async for line in response.aiter_lines():
                    if sent_error is not None or not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    try:
                        event = json.loads(line[5:])
                    except ValueError:
                        sent_error = (f"{endpoint.base_url} streamed something that is not JSON: "
                                      + endpoint.quote(repr(line))[:100])
                        continue
                    if not isinstance(event, dict) or "error" in event:
                        sent_error = f"{endpoint.base_url}: {endpoint.quote(error_text(event))}"
                        continue
                    text, finish, counted = reader(event)
                    if text:
                        queue.put_nowait({"ev": "chunk", "ids": [], "text": text, "tokens": 1})
                    reason, usage = finish or reason, counted or usage
                if sent_error is not None:
                    queue.put_nowait({"ev": "error", "code": "upstream_error", "message": sent_error})
                    return
        except asyncio.CancelledError:  # leaving the `async with` closed the connection: the upstream stops
            queue.put_nowait({"ev": "done", "reason": "cancelled", "input_tokens": 0})
            raise
        except (httpx2.TransportError, httpx2.HTTPStatusError, ValueError, KeyError, RemoteError) as exc:
            error = exc if isinstance(exc, RemoteError) else transport_error(endpoint, exc)
            if opened:
                error = RemoteError(error.code, f"{endpoint.base_url} broke off the stream ({exc.__class__.__name__}).")
            endpoint.mark(error)
            queue.put_nowait({"ev": "broken" if opened else "failed", "message": error.message})
            return
        if reason is None:  # the stream ended without saying why: it was cut
            queue.put_nowait({"ev": "broken", "message": f"{endpoint.base_url} ended the stream early."})
            return
        queue.put_nowait({"ev": "done", "reason": reason, "cached_tokens": 0, **usage})

    async def generate(self, gen: Generation) -> AsyncIterator[Message]:
        """Yield `chunk` messages, then one `done`, like a local engine; a `reset` first when the
        stream starts the output again (an endpoint that cannot continue it)."""
        try:
            while True:
                if self._endpoint is None:  # cancelled before a stream opened
                    yield {"ev": "done", "reason": "cancelled", "input_tokens": 0}
                    return
                if self._restart:
                    yield {"ev": "reset", "resume_mode": "retry"}
                    self.text, self.tokens, self._restart = "", 0, False
                while (msg := await self._queue.get())["ev"] == "chunk":
                    self.text += msg["text"]
                    self.tokens += 1
                    yield msg
                if msg["ev"] == "done":
                    yield msg
                    return
                # The upstream broke: another endpoint carries on, or the task fails.
                self._release()
                if msg["ev"] == "error":
                    raise EngineError(msg["code"], msg["message"])
                errors = [msg["message"], *await self._connect()]
                if self._endpoint is None and not self._cancelled.is_set():
                    raise EngineError("upstream_unavailable", " ".join(errors))
        finally:
            if self._pump is not None:
                self._pump.cancel()  # a runner that stops reading closes the stream too
            self._release()

    def _release(self) -> None:
        if self._endpoint is not None:
            self._endpoint.running -= 1
        self._endpoint = None

    def cancel(self) -> None:
        """Stop the task: its stream's connection is closed, which stops the upstream's generation."""
        self._cancelled.set()
        if self._pump is not None:
            self._pump.cancel()

