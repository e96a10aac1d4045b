"""Who may forget a model: an app with `models:write` forgets the models it registered, and no
other: the owner's (the default model among them), other apps' and remote models (whose API keys
go with them) need `admin`. Nor can an app take a model's id for a file of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.helpers import bearer, check_error, pair, raw
from tests.hub_server import FakeHub
from tests.test_downloads import MODEL, REPO, fake_hub, finished  # noqa: F401 (fake_hub: a fixture)
from tests.test_gguf import make_gguf, valid_kvs, valid_tensors
from tests.test_remote import KEY, register

MODELER = ["models:read", "models:write"]


async def as_app(api: Any, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    resp, text = await raw(api, method, path, headers=bearer(token), json=body)
    return resp.status, text


async def listed(api: Any) -> set[str]:
    return {m["id"] for m in (await (await api.get("/v1/models")).json())["data"]}


def tiny_model(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(make_gguf(valid_kvs(), valid_tensors()))
    return str(path)


async def test_an_app_forgets_only_the_models_it_registered(api: Any, tmp_path: Path) -> None:
    _, first = await pair(api, MODELER, "First")
    _, second = await pair(api, MODELER, "Second")
    status, text = await as_app(api, first, "POST", "/v1/models", {"path": tiny_model(tmp_path, "a"), "id": "firsts"})
    assert status == 201, text
    for token, model_id in ((second, "firsts"), (second, DEFAULT_MODEL_ID), (first, DEFAULT_MODEL_ID)):
        status, text = await as_app(api, token, "DELETE", f"/v1/models/{model_id}")
        err = check_error(status, text, 403, "not_model_creator")
        assert model_id in err["message"] and "registered" in err["message"]
    assert {DEFAULT_MODEL_ID, "firsts"} <= await listed(api)
    status, text = await as_app(api, first, "DELETE", "/v1/models/firsts")
    assert status == 200 and json.loads(text)["deleted"] is True, text
    # The owner may forget any app's model.
    status, text = await as_app(api, second, "POST", "/v1/models", {"path": tiny_model(tmp_path, "b"), "id": "seconds"})
    assert status == 201, text
    assert (await api.delete("/v1/models/seconds")).status == 200
    assert await listed(api) == {DEFAULT_MODEL_ID}


async def test_a_downloaded_model_is_the_downloading_apps(api: Any, fake_hub: FakeHub) -> None:  # noqa: F811 (a fixture)
    _, first = await pair(api, MODELER, "First")
    _, second = await pair(api, MODELER, "Second")
    status, text = await as_app(api, first, "POST", "/v1/models/downloads", {"repo": REPO, "file": MODEL.name})
    assert status == 202, text
    done = await finished(api, json.loads(text)["id"])
    assert done["status"] == "completed", done
    model_id = done["download"]["model_id"]
    status, text = await as_app(api, second, "DELETE", f"/v1/models/{model_id}")
    check_error(status, text, 403, "not_model_creator")
    status, text = await as_app(api, first, "DELETE", f"/v1/models/{model_id}")
    assert status == 200, text


async def test_an_app_can_neither_forget_nor_take_over_a_remote_model(api: Any, upstreams: Any,
                                                                       tmp_path: Path) -> None:
    up, = upstreams(1)
    await register(api, "big", up, key=KEY)
    _, token = await pair(api, MODELER)
    status, text = await as_app(api, token, "DELETE", "/v1/models/big")
    err = check_error(status, text, 403, "insufficient_scope")
    assert "remote" in err["message"] and "admin" in err["message"]
    # Its id cannot be had for a file of the app's choosing, and its key is still there.
    status, text = await as_app(api, token, "POST", "/v1/models", {"path": tiny_model(tmp_path, "x"), "id": "big"})
    check_error(status, text, 409, "model_exists")
    model = await (await api.get("/v1/models/big")).json()
    assert model["format"] == "remote" and model["endpoints"][0]["has_api_key"], model
    assert [p.read_text() for p in (tmp_path / "data").glob("api_key_*")] == [KEY]
    assert (await api.delete("/v1/models/big")).status == 200  # the owner may
    assert not list((tmp_path / "data").glob("api_key_*"))
