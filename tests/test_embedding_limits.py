"""What one embeddings request may cost the others (red-team N4, N8): a token budget refused up
front, the engine freed within two seconds of its client leaving, and answers not stored under
an Idempotency-Key. Real inference with the default model, on the production server."""

from __future__ import annotations

import array
import asyncio
import base64
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from app.server.app import Server
from tests.helpers import expect_error

BUDGET = 32768  # tokens: 8 of the default model's contexts (app/resources/openapi.yaml)
LONG = "1 2 3 4 5 6 7 8 9 0 " * 195  # ~3,900 tokens: one input near the context's length
SOME = "1 2 3 4 5 6 7 8 9 0 " * 20  # ~400 tokens


async def test_an_input_over_the_budget_is_refused_at_once_naming_it(api: Any) -> None:
    inputs = [LONG] * (BUDGET // 3900 + 1)  # each fits; together over the budget
    started = time.monotonic()
    resp = await api.post("/v1/embeddings", json={"input": inputs}, timeout=aiohttp.ClientTimeout(total=60))
    err = await expect_error(resp, 400, "too_many_tokens", "input")
    assert f"{BUDGET} tokens" in err["message"], err
    # Counted, not computed (which takes minutes): the model's load and the tokenizer, no more.
    assert time.monotonic() - started < 15, time.monotonic() - started


async def request_then_leave(url: str, token: str, body: dict[str, Any], after: float) -> None:
    """Send `body` to /v1/embeddings on a plain socket, then close it `after` seconds later
    without reading an answer, as a client that gives up does."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(f"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    try:
        early = await asyncio.wait_for(reader.read(100), after)
    except TimeoutError:
        early = b""
    assert not early, early  # still working: no answer yet
    writer.close()
    await writer.wait_closed()


async def say_hi(session: Any, url: str) -> float:
    """Seconds a 2-token answer takes (the engine's turn included)."""
    started = time.monotonic()
    async with session.post(url + "/v1/responses", json={"input": "Say hi.", "max_output_tokens": 2},
                            timeout=aiohttp.ClientTimeout(total=60)) as resp:
        assert resp.status == 200, await resp.text()
    return time.monotonic() - started


async def test_a_client_that_leaves_frees_the_engine_within_two_seconds(api: Any, service: Any) -> None:
    """On the production server (the test server cancels a handler on disconnect by itself)."""
    server = Server(service)
    url = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api.token}"}) as session:
            await say_hi(session, url)  # loads the model
            alone = await say_hi(session, url)  # what the answer costs by itself
            # ~31,000 tokens, within the budget: minutes of work, each input a few seconds of it.
            await request_then_leave(url, api.token, {"input": [SOME] * 78}, after=1.0)
            waited = await say_hi(session, url)
        assert waited < alone + 2.0, (waited, alone)
        # The embedding server drops the inputs nobody waits for (the one under way ends first: llama.cpp
        # does not stop a batch midway), and answers its own question: the abandoned vectors are not
        # taken for it.
        started = time.monotonic()
        resp = await api.post("/v1/embeddings", json={"input": ["one", "two"]})
        assert resp.status == 200 and len((await resp.json())["data"]) == 2
        assert time.monotonic() - started < 20, time.monotonic() - started
    finally:
        await server.stop()


def db_bytes(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in data_dir.glob("lmsp.sqlite3*"))


async def test_vectors_are_not_stored_under_an_idempotency_key(api: Any, service: Any) -> None:
    body = {"input": [f"item number {i}" for i in range(128)], "encoding_format": "base64"}
    headers = {"Idempotency-Key": "embed-once"}
    before = db_bytes(service.store.path.parent)
    first = await api.post("/v1/embeddings", json=body, headers=headers)
    assert first.status == 200, await first.text()
    answer = await first.read()
    assert len(answer) > 375_000  # 128 vectors of 576 floats, base64
    assert db_bytes(service.store.path.parent) - before < len(answer) / 4
    # A retry computes the vectors again (the same ones, to rounding: batches follow the computer's
    # pace), and says it is no replay.
    again = await api.post("/v1/embeddings", json=body, headers=headers)
    assert again.status == 200 and "Idempotent-Replayed" not in again.headers
    for old, new in zip(json.loads(answer)["data"], (await again.json())["data"], strict=True):
        a, b = (array.array("f", base64.b64decode(d["embedding"])) for d in (old, new))
        assert sum(x * y for x, y in zip(a, b)) > 0.999, old["index"]  # as test_embeddings, alone vs in a batch
