"""app/resources/openapi.yaml is kept true to the code: the same routes and scopes as `ROUTES`, served
as-is at GET /openapi.json, and every scoped route really refuses a missing token (401) and a
token without its scope (403)."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import pytest
import yaml

from app import paths
from app.core.auth import SCOPES
from app.core.ollama import is_ollama_path
from app.server.app import ROUTES

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
DOC: dict[str, Any] = yaml.safe_load(paths.resource("openapi.yaml").read_text(encoding="utf-8"))


def operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(method.upper(), path): op for path, item in doc["paths"].items()
            for method, op in item.items() if method in METHODS}


def node_ref(ref: str) -> list[str]:
    assert ref.startswith("#/"), ref
    return [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]


def deref(doc: dict[str, Any], node: Any) -> Any:
    for _ in range(20):
        if not (isinstance(node, dict) and "$ref" in node):
            return node
        target: Any = doc
        for part in node_ref(node["$ref"]):
            target = target[part]
        node = target
    raise AssertionError("$ref chain too long")


def path_parameters(doc: dict[str, Any], path: str, method: str) -> set[str]:
    item = doc["paths"][path]
    params = [deref(doc, p) for p in item.get("parameters", []) + item[method.lower()].get("parameters", [])]
    return {p["name"] for p in params if p["in"] == "path"}


ROUTE_SCOPES = {(method, path): scope for method, path, _handler, scope in ROUTES}


# -- (a) the document and ROUTES agree ---------------------------------------------------------

def test_document_is_openapi_3_1() -> None:
    assert DOC["openapi"].startswith("3.1")
    bearer = DOC["components"]["securitySchemes"]["bearerAuth"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")


def test_every_route_is_documented_and_nothing_else() -> None:
    documented = set(operations(DOC))
    assert len(ROUTE_SCOPES) == len(ROUTES), "a route appears twice in ROUTES"
    assert set(ROUTE_SCOPES) - documented == set(), "routes missing from openapi.yaml"
    assert documented - set(ROUTE_SCOPES) == set(), "operations in openapi.yaml that no route serves"


@pytest.mark.parametrize("method,path", sorted(ROUTE_SCOPES), ids=lambda v: str(v))
def test_scope_and_security_match_routes(method: str, path: str) -> None:
    op = operations(DOC)[(method, path)]
    scope = ROUTE_SCOPES[(method, path)]
    assert op.get("x-lmsp-scope") == scope
    if scope is None:
        assert op.get("security") == [], "an open route must say `security: []`"
        assert "401" not in op["responses"]
    else:
        assert op.get("security") == [{"bearerAuth": []}]
        assert f"`{scope}`" in op.get("description", ""), "the scope is named in the description"
        assert {"401", "403"} <= set(op["responses"])
        assert scope in SCOPES


@pytest.mark.parametrize("method,path", sorted(ROUTE_SCOPES), ids=lambda v: str(v))
def test_path_parameters_are_declared(method: str, path: str) -> None:
    assert path_parameters(DOC, path, method) == set(re.findall(r"{([^}]+)}", path))


def test_every_ref_resolves() -> None:
    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                deref(DOC, node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(DOC)


def test_documented_shapes() -> None:
    schemas = DOC["components"]["schemas"]
    assert schemas["Error"]["properties"]["error"]["required"] == ["type", "code", "message", "param"]
    create = schemas["ResponseCreateRequest"]["properties"]
    for field in ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "stop",
                  "metadata", "stream", "background", "store", "on_restart"):
        assert field in create, field
    from app.core.requests import KNOWN
    assert set(create) == KNOWN, "every parameter POST /v1/responses accepts, and only those"
    from app.server.chat import ALLOWED
    assert set(schemas["ChatCompletionRequest"]["properties"]) == ALLOWED
    from app.store.config import VALIDATORS
    assert set(schemas["SettingsPatch"]["properties"]) == set(VALIDATORS)
    assert schemas["SettingsPatch"]["additionalProperties"] is False
    events = set(schemas["EventType"]["enum"])
    assert {"response.loading", "response.cancelling"} <= events
    from app.core.tasks import TERMINAL_EVENTS
    assert set(TERMINAL_EVENTS) <= events
    assert {"attempt", "output_reset", "progress"} <= set(schemas["Event"]["properties"])
    ops = operations(DOC)
    for key in (("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
                ("GET", "/v1/tasks/{task_id}/events"), ("POST", "/v1/chat/completions")):
        assert "text/event-stream" in ops[key]["responses"]["200"]["content"], key
    create_op = ops[("POST", "/v1/responses")]
    assert "Idempotency-Key" in {deref(DOC, p)["name"] for p in create_op["parameters"]}
    assert "Idempotent-Replayed" in create_op["responses"]["200"]["headers"]
    assert {"200", "202", "400", "401", "403", "404", "409", "413", "422"} <= set(create_op["responses"])


# -- (b) the server serves this document -------------------------------------------------------

async def test_openapi_json_is_the_document(api: Any) -> None:
    resp = await api.get("/openapi.json", headers={"Authorization": ""})
    assert resp.status == 200
    assert resp.content_type == "application/json"
    assert await resp.json() == DOC


# -- (c) the scopes are enforced, route by route -------------------------------------------------

async def _token_with(service: Any, scopes: list[str]) -> str:
    created = await service.access.request_pairing({"client_name": "t", "scopes": scopes})
    await service.access.approve_pairing(created["id"])
    shown = await service.access.pairing_status(created["id"])
    return shown["token"]


def _concrete(path: str) -> str:
    return re.sub(r"{[^}]+}", "x", path)


async def test_every_scoped_route_needs_a_token_with_its_scope(service: Any, api: Any) -> None:
    ordinary = [s for s in SCOPES if s != "admin"]
    # For each scope, a token holding every other ordinary scope (never `admin`, which implies all).
    lacking = {scope: await _token_with(service, [s for s in ordinary if s != scope]) for scope in SCOPES}
    await service.settings.update({"ollama_api": "token"})  # Ollama's routes (LMSP §15) answer too
    checked = 0
    async with aiohttp.ClientSession() as bare:  # no default Authorization header
        for method, path, _handler, scope in ROUTES:
            url = api.make_url(_concrete(path))
            if scope is None:
                async with bare.request(method, url) as resp:
                    assert resp.status != 401, (method, path)
                continue
            for headers, status, code in (({}, 401, "unauthorized"),
                                          ({"Authorization": "Bearer lmsp_not-a-token"}, 401, "unauthorized"),
                                          ({"Authorization": f"Bearer {lacking[scope]}"}, 403, "insufficient_scope")):
                async with bare.request(method, url, headers=headers) as resp:
                    body = await resp.json()
                    assert resp.status == status, (method, path, headers, body)
                    if is_ollama_path(path):  # in Ollama's words, which its clients show
                        assert set(body) == {"error"} and isinstance(body["error"], str), (method, path, body)
                        continue
                    assert set(body["error"]) == {"type", "code", "message", "param"}
                    assert body["error"]["code"] == code, (method, path, body)
            checked += 1
    assert checked == sum(1 for *_, scope in ROUTES if scope is not None)
