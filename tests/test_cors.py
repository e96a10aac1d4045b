"""Browser clients (LMSP §16) over HTTP: the preflight the official `openai` JavaScript SDK makes,
the headers its scripts may read, and the origins that go with a client paired from a page (the
same in a real browser: tests/test_browser.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from app.core import pairing
from app.core.access import Access
from tests.helpers import SAY_HI, bearer, check_error, expect_error, pair, raw

pytestmark = pytest.mark.scripted

PAGE, OTHER = "http://localhost:5173", "http://localhost:5174"
# What the SDK's preflight before POST /v1/responses asks for, as Chromium sends it (lower case).
SDK_ASKS = ("authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,x-stainless-package-version,"
            "x-stainless-retry-count,x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout")
EXPOSED = {"location", "idempotent-replayed", "retry-after", "x-request-id", "openai-poll-after-ms"}


async def preflight(api: Any, origin: str, path: str = "/v1/responses", asks: str = SDK_ASKS) -> Any:
    resp, _ = await raw(api, "OPTIONS", path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                      "Access-Control-Request-Headers": asks})
    return resp


def names(value: str) -> set[str]:
    return {name.strip().lower() for name in value.split(",")}


async def pair_from(api: Any, origin: str, name: str = "Notes page") -> tuple[str, str]:
    """A page of `origin` pairs, the owner allows it: (client id, token)."""
    resp, text = await raw(api, "POST", "/v1/pairings", headers={"Origin": origin},
                           json={"client_name": name, "scopes": ["responses:write", "tasks:read"]})
    assert resp.status == 202 and resp.headers["Access-Control-Allow-Origin"] == origin, text
    created = json.loads(text)
    assert created["origin"] == origin
    assert (await api.post(f"/v1/pairings/{created['id']}/approve")).status == 200
    resp, text = await raw(api, "GET", f"/v1/pairings/{created['id']}", headers={"Origin": origin})
    assert resp.headers["Access-Control-Allow-Origin"] == origin, text
    body = json.loads(text)
    return body["client_id"], body["token"]


async def test_preflights_allow_what_the_openai_sdk_sends_and_scripts_read_its_headers(api, service):
    await service.settings.update({"allowed_origins": [PAGE]})
    resp = await preflight(api, PAGE, asks=SDK_ASKS + ",openai-beta,idempotency-key,last-event-id,accept,"
                                                      "x-requested-with,x-evil,x-stainless-bad header")
    assert resp.status == 204 and resp.headers["Access-Control-Allow-Origin"] == PAGE
    allowed = names(resp.headers["Access-Control-Allow-Headers"])
    assert set(SDK_ASKS.split(",")) <= allowed  # Authorization named: a `*` would not cover it
    assert {"openai-beta", "idempotency-key", "last-event-id", "accept", "x-requested-with"} <= allowed
    assert "x-evil" not in allowed and "x-stainless-bad header" not in allowed  # not read: not allowed
    assert not any("*" in v for v in resp.headers.values()), dict(resp.headers)
    assert int(resp.headers["Access-Control-Max-Age"]) > 0 and "POST" in resp.headers["Access-Control-Allow-Methods"]

    resp = await api.post("/v1/responses", json={**SAY_HI, "background": True}, headers={"Origin": PAGE})
    assert resp.status == 202 and "Location" in resp.headers
    assert names(resp.headers["Access-Control-Expose-Headers"]) == EXPOSED
    resp, _ = await raw(api, "GET", "/v1/tasks", headers={"Origin": PAGE})  # errors too (a 401 here)
    assert resp.status == 401 and names(resp.headers["Access-Control-Expose-Headers"]) == EXPOSED


async def test_a_page_paired_from_its_origin_uses_its_own_token_only(api, service):
    # Not yet allowed: the page may still ask to pair (and its preflight for that is answered).
    assert (await preflight(api, PAGE, "/v1/pairings", "content-type")).status == 204
    assert (await preflight(api, PAGE)).status == 403
    client_id, token = await pair_from(api, PAGE)
    _, native = await pair(api, ["responses:write", "tasks:read"], "Editor")
    assert (await preflight(api, PAGE)).status == 204

    resp, text = await raw(api, "POST", "/v1/responses", headers={"Origin": PAGE, **bearer(token)}, json=SAY_HI)
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == PAGE, text
    # Another app's token from this page, the owner's too: refused, and the page may read why.
    for other_token in (native, api.token):
        resp, _ = await raw(api, "GET", "/v1/tasks", headers={"Origin": PAGE, **bearer(other_token)})
        await expect_error(resp, 403, "origin_not_allowed")
        assert resp.headers["Access-Control-Allow-Origin"] == PAGE
    # This token from a page of another origin: refused before any work, no CORS headers.
    assert (await preflight(api, OTHER)).status == 403
    resp, _ = await raw(api, "POST", "/v1/responses", headers={"Origin": OTHER, **bearer(token)}, json=SAY_HI)
    await expect_error(resp, 403, "origin_not_allowed")
    assert "Access-Control-Allow-Origin" not in resp.headers

    clients = {c["name"]: c for c in (await (await api.get("/v1/clients")).json())["data"]}
    assert clients["Notes page"]["origins"] == [PAGE] and clients["Editor"]["origins"] == []
    again = Access(service.store, service.bus, service.access.vault, service.settings)  # as the next start reads them
    await again.load_origins()
    assert again.origin_known(PAGE) and not again.origin_known(OTHER)

    # Removing the app removes its origin.
    assert (await api.delete(f"/v1/clients/{client_id}")).status == 200
    assert (await preflight(api, PAGE)).status == 403
    resp, _ = await raw(api, "GET", "/v1/tasks", headers={"Origin": PAGE, **bearer(token)})
    await expect_error(resp, 403, "origin_not_allowed")
    assert await service.store.read(lambda c: c.execute("SELECT count(*) FROM client_origins").fetchone()[0]) == 0


async def test_an_origin_the_owner_allows_may_use_any_token(api, service):
    _, token = await pair_from(api, PAGE)
    await service.settings.update({"allowed_origins": [OTHER]})
    for other_token in (token, api.token):
        resp, text = await raw(api, "GET", "/v1/tasks", headers={"Origin": OTHER, **bearer(other_token)})
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == OTHER, text


async def test_a_page_without_a_web_origin_cannot_pair(api, service):
    for origin in ("null", "file://"):  # a sandboxed frame or a file: any page could be it
        resp, _ = await raw(api, "POST", "/v1/pairings", headers={"Origin": origin},
                            json={"client_name": "Notes page", "scopes": ["responses:write"]})
        await expect_error(resp, 403, "origin_not_allowed")
    assert await service.store.read(lambda c: c.execute("SELECT count(*) FROM pairings").fetchone()[0]) == 0


async def test_a_page_filling_its_share_of_pairing_requests_leaves_local_apps_theirs(api):
    for n in range(pairing.MAX_PENDING_PER_REQUESTER):
        resp, text = await raw(api, "POST", "/v1/pairings", headers={"Origin": PAGE},
                               json={"client_name": f"Page {n}", "scopes": ["responses:write"]})
        assert resp.status == 202, text
    resp, _ = await raw(api, "POST", "/v1/pairings", headers={"Origin": PAGE},
                        json={"client_name": "One more", "scopes": ["responses:write"]})
    await expect_error(resp, 429, "too_many_pairings")
    resp, text = await raw(api, "POST", "/v1/pairings", json={"client_name": "Editor", "scopes": ["responses:write"]})
    assert resp.status == 202 and json.loads(text)["origin"] is None, text


async def pair_with_origin(api: Any, origin: str) -> tuple[int, str]:
    """A pairing request whose Origin header is `origin` in UTF-8, as a local process can send it
    (a browser never would): (status, body)."""
    url = api.make_url("/v1/pairings")
    reader, writer = await asyncio.open_connection(url.host, url.port)
    body = json.dumps({"client_name": "Docs helper", "scopes": ["models:read"]}).encode()
    writer.write(b"POST /v1/pairings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nOrigin: "
                 + origin.encode() + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    answer = await reader.read()  # to the end: the service closes the connection
    writer.close()
    head, _, text = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), text.decode()


async def test_an_origin_is_what_a_browser_sends_so_the_pairing_window_cannot_name_another_site(api, service):
    """The red team's P8: bidi controls (shown as https://google.com), look-alike letters and
    control characters are refused, in a pairing and in allowed_origins; punycode is an origin."""
    spoofs = ("https://\u202emoc.elgoog\u202c",  # right-to-left override: reads https://google.com
              "https://g\u0456thub.com",  # a Cyrillic і
              "https://bank.example\u200b.evil.example",  # a zero-width space
              "https://a\u0085b.example")  # a C1 control
    for origin in spoofs:
        status, text = await pair_with_origin(api, origin)
        error = check_error(status, text, 400, "invalid_request")
        assert "not one a browser sends" in error["message"] and "punycode" in error["message"], error
        resp = await api.patch("/v1/settings", json={"allowed_origins": [origin]})
        error = await expect_error(resp, 400, "invalid_request", param="allowed_origins")
        assert "punycode" in error["message"], error
    status, _ = await pair_with_origin(api, "https://a\x1b]0;x\x07.example")  # the HTTP parser may refuse it first
    assert status == 400
    assert await service.store.read(lambda c: c.execute("SELECT count(*) FROM pairings").fetchone()[0]) == 0
    assert service.settings["allowed_origins"] == []

    for origin in ("https://xn--gthub-2ve.com", "http://[::1]:8080", "http://127.0.0.1:3000"):
        status, text = await pair_with_origin(api, origin)
        assert status == 202 and json.loads(text)["origin"] == origin, text
    resp = await api.patch("/v1/settings", json={"allowed_origins": ["https://xn--gthub-2ve.com"]})
    assert resp.status == 200, await resp.text()
