"""Ollama's API (LMSP §15), for the apps built for it: Open WebUI, Continue, the `ollama` packages.

Every route translates (app/server/ollama_shapes.py) and calls the same core as /v1: a chat or a
generate is a response created and answered by `answers.respond` (a task of the calling client, on
the dashboard, in its limits, cancelled when the client leaves), sent as NDJSON (one JSON object
a line and a write) or as one object. Errors are Ollama's `{"error": "..."}` (app/server/middleware.py); one that comes
after a stream started is its last line, the status staying 200, as Ollama does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from app.core import answers
from app.core import ollama as names
from app.core.answers import Ask
from app.core.caller import unless_left
from app.core.follow import Events, follow
from app.core.structured import reasoning
from app.errors import LmspError, NotFound
from app.server import ollama_shapes as shapes
from app.server.handlers import _json_by_item, caller_left
from app.server.keys import CLIENT, SERVICE
from app.server.middleware import read_json

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NDJSON = "application/x-ndjson"
# The Ollama API level these shapes follow: apps compare it with the least version they need
# (Open WebUI and VS Code Copilot parse it as dotted numbers).
VERSION = "0.12.0"


async def _model(request: web.Request, body: Any) -> tuple[str, str]:
    """(the Ollama name the body gives in `model`, or the older `name`; the id of our model it means)."""
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise LmspError("invalid_request", "`model` is required.", param="model", status=400)
    model_id = await request.app[SERVICE].models.ollama_id(name)
    if model_id is None:
        raise NotFound("model", name)
    return name, model_id


async def _body(request: web.Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise LmspError("invalid_request", "The request body must be a JSON object.", status=400)
    return body


def _stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is not False  # Ollama streams unless told not to


async def running(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


async def tags(request: web.Request) -> web.Response:
    models = request.app[SERVICE].models
    listed = await models.list_models()
    return web.json_response({"models": [shapes.model_entry(m, models.header(m)) for m in listed]})


async def ps(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    loaded = [m for m in await service.models.list_models() if m["status"] == "loaded"]
    ttl = service.settings["model_idle_ttl_seconds"]
    return web.json_response({"models": [shapes.running_entry(m, service.models.header(m), service.models.kept_for(m),
                                                               ttl) for m in loaded]})


async def show(request: web.Request) -> web.Response:
    _, model_id = await _model(request, await _body(request))
    models = request.app[SERVICE].models
    model = await models.model(model_id)
    return web.json_response(shapes.show(model, models.header(model), models.fills_in(model)))


async def delete(request: web.Request) -> web.Response:
    """Forgets the model; its file stays where it is (a downloaded one in the hub's cache)."""
    _, model_id = await _model(request, await _body(request))
    await request.app[SERVICE].models.remove_model(model_id, request[CLIENT])
    return web.Response()


@dataclass(frozen=True)
class Kind:
    """How chat and generate differ: where the text goes in each line."""
    path: str
    translate: Callable[[dict[str, Any], str], dict[str, Any]]
    source: str  # the field the input came from, to name it in errors

    def text(self, text: str, tool_calls: list[dict[str, Any]] | None = None,
             thinking: str | None = None) -> dict[str, Any]:
        said = {} if thinking is None else {"thinking": thinking}
        if self.path == "/api/generate":
            return {"response": text, **said}
        message: dict[str, Any] = {"role": "assistant", "content": text, **said}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"message": message}


CHAT = Kind("/api/chat", shapes.chat_request, "messages")
GENERATE = Kind("/api/generate", shapes.generate_request, "prompt")


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generation(request, CHAT)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generation(request, GENERATE)


async def _generation(request: web.Request, kind: Kind) -> web.StreamResponse:
    started = time.monotonic_ns()
    service = request.app[SERVICE]
    body = await _body(request)
    name, model_id = await _model(request, body)
    keep = names.keep_alive(body.get("keep_alive"))
    if not body.get(kind.source):  # an empty prompt loads the model, or unloads it (keep_alive 0)
        return web.json_response(await _load(request, kind, name, model_id, keep))
    translated = await service.off_loop(kind.translate, body, model_id)
    if request[CLIENT].party is not None:
        # An app without a token can never read it back; Ollama keeps nothing either. So its prompt
        # and output leave the disk a minute after the answer (LMSP §12): no app fills it for all.
        translated["store"] = False
    ask = Ask(request[CLIENT], translated, None, _stream(body), path=kind.path, sent=body,
              rename=shapes.OllamaNames(kind.source))
    async with answers.respond(service, ask, caller_left(request)) as answered:
        if answered.events is not None:
            sent = await _ndjson(request, answered.events, kind, name, started)
        else:
            final = answered.body
            sent = web.json_response({"model": name, "created_at": shapes.iso(time.time()),
                                      **kind.text(final["output_text"], shapes.calls(final["output"]),
                                                  reasoning(final["output"])),
                                      **_done(final, started, None)})
    if keep is not None:
        await service.models.keep_loaded(model_id, keep, request[CLIENT])
    return sent


def _done(final: dict[str, Any], started: int, first: int | None) -> dict[str, Any]:
    return {"done": True, "done_reason": shapes.done_reason(final), **shapes.counts(final.get("usage"), started, first)}


async def _load(request: web.Request, kind: Kind, name: str, model_id: str, keep: float | None) -> dict[str, Any]:
    """An empty prompt: Ollama's way to load a model, or unload it (`keep_alive` 0). An app without
    `models:write` evicts no other model and unloads none that other apps use (`Models.load_model`,
    `keep_loaded`); it gets Ollama's answer all the same, as its next request works either way."""
    models, client = request.app[SERVICE].models, request[CLIENT]
    if keep != 0 and (await models.model(model_id))["status"] != "loaded":
        await unless_left(caller_left(request), models.load_model(model_id, client))
    if keep is not None:
        await models.keep_loaded(model_id, keep, client)
    return {"model": name, "created_at": shapes.iso(time.time()), **kind.text(""), "done": True,
            "done_reason": "unload" if keep == 0 else "load"}


async def _lines(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": NDJSON})
    await out.prepare(request)
    return out


async def _line(out: web.StreamResponse, obj: dict[str, Any]) -> None:
    await out.write(orjson.dumps(obj) + b"\n")


async def _ndjson(request: web.Request, events: Events, kind: Kind, name: str, started: int) -> web.StreamResponse:
    """A response's events as Ollama's stream: a line a piece of text or a tool call, then the last
    line with the counts; a failure, the line `{"error": ...}`."""
    out = await _lines(request)
    first: int | None = None
    async with contextlib.aclosing(events):
        async for event in events:
            if event is None:
                continue
            kind_of, line = event["type"], None
            if kind_of == "response.output_text.delta":
                first = first or time.monotonic_ns()
                line = kind.text(event["delta"])
            elif kind_of == "response.reasoning_text.delta":
                first = first or time.monotonic_ns()
                line = kind.text("", thinking=event["delta"])
            elif kind_of == "response.output_item.done" and event["item"]["type"] == "function_call":
                first = first or time.monotonic_ns()
                line = kind.text("", [shapes.tool_call(event["item"])])
            elif kind_of in ("response.completed", "response.incomplete"):
                line = {**kind.text(""), **_done(event["response"], started, first)}
            elif kind_of == "response.failed":
                await _line(out, {"error": event["response"]["error"]["message"]})
            elif kind_of == "response.cancelled":
                await _line(out, {"error": "The request was cancelled."})
            if line is not None:  # the last line's `done` is true
                await _line(out, {"model": name, "created_at": shapes.iso(time.time()), "done": False, **line})
    return out


async def embed(request: web.Request) -> web.Response:
    body = await _body(request)
    name, model_id = await _model(request, body)
    started = time.monotonic_ns()
    answer = await _vectors(request, model_id, body.get("input"), body.get("dimensions"))
    made = {"model": name, "total_duration": time.monotonic_ns() - started, "load_duration": 0,
            "prompt_eval_count": answer["usage"]["prompt_tokens"],
            "embeddings": [d["embedding"] for d in answer["data"]]}
    return web.Response(body=await request.app[SERVICE].off_loop(_json_by_item, made, "embeddings"),
                        content_type="application/json")


async def embeddings(request: web.Request) -> web.Response:
    """The older route: one `prompt`, one `embedding`."""
    body = await _body(request)
    _, model_id = await _model(request, body)
    answer = await _vectors(request, model_id, body.get("prompt"), None)
    made = {"embedding": answer["data"][0]["embedding"]}
    return web.Response(body=await request.app[SERVICE].off_loop(orjson.dumps, made, None,
                                                                 orjson.OPT_SERIALIZE_NUMPY),
                        content_type="application/json")


async def _vectors(request: web.Request, model_id: str, texts: Any, dimensions: Any) -> dict[str, Any]:
    asked = {"model": model_id, "input": texts, **({"dimensions": dimensions} if dimensions else {})}
    try:
        embeddings = request.app[SERVICE].embeddings
        return await unless_left(caller_left(request), embeddings.embed(asked, request[CLIENT].app))
    except LmspError as exc:
        shapes.OllamaNames("prompt" if request.path.endswith("embeddings") else "input")(exc)
        raise


async def pull(request: web.Request) -> web.StreamResponse:
    """A durable download (LMSP §13) of the file the Hugging Face name means, its progress as
    Ollama's. It goes on if the client leaves: pulling the same name again follows it."""
    service = request.app[SERVICE]
    body = await _body(request)
    name = body.get("model") or body.get("name")
    repo, tag = names.hub_file(name)
    files = await service.downloads.hub_files(repo)
    file = names.choose_file([f["file"] for f in files], tag)
    if file is None:
        raise NotFound("file", f"{name} (no GGUF file of {repo} is named for {tag or names.DEFAULT_QUANT})")
    task = await service.downloads.create_download(request[CLIENT], {"repo": repo, "file": file})
    statuses = _pulled(follow(service.tasks, task["id"], -1))
    if not _stream(body):
        last = [status async for status in statuses][-1]
        if "error" in last:
            raise LmspError("download_failed", last["error"], status=500)
        return web.json_response(last)
    out = await _lines(request)
    async for status in statuses:
        await _line(out, status)
    return out


async def _pulled(events: Events) -> AsyncIterator[dict[str, Any]]:
    """A download's events as Ollama's pull statuses."""
    yield {"status": "pulling manifest"}
    async with contextlib.aclosing(events):
        async for event in events:
            if event is None:
                continue
            kind = event["type"]
            if kind in ("download.started", "download.progress"):
                yield {"status": "pulling model", "total": event.get("total_bytes") or 0,
                       "completed": event.get("bytes") or 0}
            elif kind == "download.verifying":  # all there (progress is said at most so often)
                yield {"status": "pulling model", "total": event["bytes"], "completed": event["bytes"]}
                yield {"status": "verifying sha256 digest"}
            elif kind == "download.completed":
                yield {"status": "writing manifest"}
                yield {"status": "success"}
            elif kind == "download.failed":
                yield {"error": str((event.get("error") or {}).get("message") or "The download failed.")}
            elif kind == "download.cancelled":
                yield {"error": "The download was cancelled."}


# Every route of Ollama's API that LMSP serves, and the scope each needs (None: open, as /health).
# Their errors are Ollama's (app/server/middleware.py `ollama_surface`).
ROUTES: list[tuple[str, str, Handler, str | None]] = [
    ("GET", "/", running, None),
    ("HEAD", "/", running, None),
    ("GET", "/api/version", version, None),
    ("GET", "/api/tags", tags, "models:read"),
    ("POST", "/api/show", show, "models:read"),
    ("GET", "/api/ps", ps, "models:read"),
    ("POST", "/api/chat", chat, "responses:write"),
    ("POST", "/api/generate", generate, "responses:write"),
    ("POST", "/api/embed", embed, "responses:write"),
    ("POST", "/api/embeddings", embeddings, "responses:write"),
    ("POST", "/api/pull", pull, "models:write"),
    ("DELETE", "/api/delete", delete, "models:write"),
]
