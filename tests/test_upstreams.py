"""The `upstreams` fixture: real OpenAI-compatible servers for the remote-endpoint tests start,
stream token by token, and die by SIGKILL as a crashed remote server would."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.conftest import Upstream
from tests.helpers import COUNT


def chat(upstream: Upstream, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": upstream.alias, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}


async def stream_chat(session: aiohttp.ClientSession, upstream: Upstream) -> list[dict[str, Any]]:
    """The SSE chunks of a short chat completion at temperature 0."""
    body = chat(upstream, "Say hi", 8)
    chunks = []
    async with session.post(upstream.base_url + "/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream", await resp.text()
        async for line in resp.content:
            data = line.decode().strip().removeprefix("data: ")
            if data and data != "[DONE]":
                chunks.append(json.loads(data))
    return chunks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["openai", "llama-server"])
async def test_two_upstreams_stream_and_one_dies_by_sigkill(upstreams: Any, kind: str) -> None:
    first, second = upstreams(2, kind=kind)
    assert first.port != second.port
    # A new connection per request: llama-server closes one after a streamed response without
    # saying so (no `Connection: close`), and a pooled connection reused then fails.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for upstream in (first, second):
            async with session.get(upstream.base_url + "/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == ["smollm2"]
            chunks = await stream_chat(session, upstream)
            text = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"][0]["delta"].get("content")]
            assert len(text) > 1 and "".join(text).strip(), chunks  # streamed piece by piece
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]

        # SIGKILL mid-stream: the stream ends short (no finish_reason, no [DONE]), then
        # connections are refused.
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(first.base_url + "/chat/completions", json=chat(first, COUNT, 500)) as resp:
                async for _ in resp.content:
                    first.kill()
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            await stream_chat(session, first)
        assert isinstance(refused.value.os_error, ConnectionRefusedError), refused.value
        assert await stream_chat(session, second)  # the other one is unaffected

        first.restart()
        assert await stream_chat(session, first)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["openai", "llama-server"])
async def test_an_upstream_with_an_api_key_refuses_requests_without_it(upstreams: Any, kind: str) -> None:
    (upstream,) = upstreams(kind=kind, api_key="sk-test")
    async with aiohttp.ClientSession() as session:
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                ({"Authorization": "Bearer sk-test"}, 200)):
            async with session.get(upstream.base_url + "/models", headers=headers) as resp:
                assert resp.status == status, await resp.text()
