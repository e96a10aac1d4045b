"""A plain OpenAI-compatible upstream for the remote-endpoint tests: a `llama-server` (already
started, on its own port) behind this proxy, which serves only OpenAI's /v1 API and names no
owner a client could recognise.

    python -m tests.openai_upstream --port N --server http://127.0.0.1:M

Why a proxy: the service continues a half-written answer only on llama-server, which it knows
by its /v1/models (`owned_by: "llamacpp"`) and whose /apply-template and /completion it then
uses; on any other OpenAI-compatible server (OpenAI's own, vLLM, ...) it starts the answer again
(`resume_mode: retry`). This is such a server, still generating for real: it forwards every /v1
request and streams the answer back as it comes, and a client leaving closes its request to
llama-server, which then stops, as an OpenAI server does."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

SERVER = web.AppKey("server", str)
CLIENT = web.AppKey("client", aiohttp.ClientSession)
FORWARDED = ("Authorization", "Content-Type")  # the key, checked by llama-server, and the body's type
OWNER = "lmsp-tests"


async def models(request: web.Request) -> web.Response:
    """llama-server's list, each model as OpenAI lists one: nothing says llama.cpp. A 503 while
    llama-server does not answer yet (it is starting)."""
    try:
        async with request.app[CLIENT].get(request.app[SERVER] + "/v1/models", headers=headers(request)) as resp:
            if resp.status != 200:
                return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)
            listed = (await resp.json())["data"]
    except aiohttp.ClientConnectionError:
        return web.json_response({"error": {"message": "Loading model", "code": 503}}, status=503)
    return web.json_response({"object": "list", "data": [
        {"id": m["id"], "object": "model", "created": m.get("created", 0), "owned_by": OWNER} for m in listed]})


async def forward(request: web.Request) -> web.StreamResponse:
    """The request to llama-server as it came; its answer back piece by piece, with its status."""
    url = request.app[SERVER] + request.path
    async with request.app[CLIENT].post(url, data=await request.read(), headers=headers(request)) as resp:
        answer = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.headers.get(
            "Content-Type", "application/json")})
        await answer.prepare(request)
        async for piece in resp.content.iter_any():
            await answer.write(piece)
        await answer.write_eof()
        return answer


def headers(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED if name in request.headers}


async def session(app: web.Application) -> AsyncIterator[None]:
    # No timeout: a long generation streams for as long as it takes.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as client:
        app[CLIENT] = client
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--server", required=True, help="llama-server's root URL, e.g. http://127.0.0.1:8080")
    args = parser.parse_args()
    app = web.Application()
    app[SERVER] = args.server.rstrip("/")
    app.cleanup_ctx.append(session)
    app.router.add_get("/v1/models", models)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.router.add_post(path, forward)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
