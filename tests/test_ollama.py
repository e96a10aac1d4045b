"""Ollama's API (LMSP §15) with the official `ollama` Python package, unchanged, against a real
headless service with scripted engines: what apps built for Ollama see (shapes, NDJSON, names,
errors), and that every request is a task of its client underneath. Real inference (format
schemas, embeddings' numbers): tests/test_ollama_llama.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import ollama  # a test dependency: the package apps use, never mocked
import pytest

from app import paths
from app.core.auth import OLLAMA_ID, OLLAMA_NAME
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.errors import TooManyRequests
from app.tasks import retention
from tests.conftest import Headless, free_port
from tests.helpers import http, pair_sync, wait_status, wait_until
from tests.hub_server import FakeHub, HubFile

pytestmark = pytest.mark.scripted(length=6)
NAME = f"{DEFAULT_MODEL_ID}:latest"
SCOPES = ["models:read", "models:write", "responses:write", "tasks:read"]


def _on(headless: Headless, **settings: Any) -> None:
    status, body = headless.request("PATCH", "/v1/settings", settings)
    assert status == 200, body


def _client(headless: Headless, scopes: list[str] = SCOPES) -> ollama.Client:
    _, token = pair_sync(headless.url, headless.token, scopes, "ollama-python")
    return ollama.Client(host=headless.url, headers={"Authorization": f"Bearer {token}"})


def _lines(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, str, list[bytes]]:
    """A raw streamed request: the status, content type and each line as sent."""
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read().splitlines()


def test_off_by_default_then_on_the_main_port_with_a_token(headless: Headless) -> None:
    headless.start()
    assert headless.get("/api/tags")[0] == 404
    assert headless.request("POST", "/api/chat", {"model": NAME, "messages": []})[0] == 404
    _on(headless, ollama_api="token")
    assert http(f"{headless.url}/api/tags")[0] == 401  # no token, no models
    client = _client(headless)
    assert http(f"{headless.url}/api/version")[1]["version"].replace(".", "").isdigit()
    listed = client.list()
    assert [m.model for m in listed.models] == [NAME]
    entry = listed.models[0]
    assert entry.size and entry.digest and entry.details.format == "gguf" and entry.modified_at
    shown = client.show(DEFAULT_MODEL_ID)  # without its tag, as with it
    # Not `tools` (a call cannot be forced through this API) nor `insert` (SmolLM2 has no FIM tokens).
    assert shown.capabilities == ["completion", "tools", "embedding"]
    arch = shown.modelinfo["general.architecture"]
    assert shown.modelinfo[f"{arch}.context_length"] == 4096 and "num_ctx 4096" in (shown.parameters or "")
    assert shown.details.family == arch
    assert client.ps().models == []


def test_chat_and_generate_streamed_and_not(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token")
    client = _client(headless)
    said = client.chat(model=NAME, messages=[{"role": "user", "content": "Count"}], stream=False,
                       options={"temperature": 0, "num_predict": 50})
    assert said.message.role == "assistant" and said.message.content == "1, 2, 3, 4, 5, 6"
    assert said.done and said.done_reason == "stop" and said.eval_count == 11 and said.prompt_eval_count
    assert said.total_duration and said.total_duration > 0 and said.eval_duration is not None
    parts = list(client.chat(model=NAME, messages=[{"role": "user", "content": "Count"}], stream=True,
                             options={"num_predict": 3}))
    assert "".join(p.message.content for p in parts) == "1, 2"
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 3
    made = client.generate(model=DEFAULT_MODEL_ID, prompt="Count", system="Be brief.", stream=False)
    assert made.response == "1, 2, 3, 4, 5, 6" and made.done_reason == "stop"
    pieces = list(client.generate(model=NAME, prompt="Count", stream=True))
    assert "".join(p.response for p in pieces) == "1, 2, 3, 4, 5, 6" and pieces[-1].done
    assert client.ps().models[0].model == NAME and client.ps().models[0].expires_at  # loaded now
    # Each was a task of the app that asked, as any response is.
    tasks = headless.get("/v1/tasks?limit=100")[1]["data"]
    assert len([t for t in tasks if t["kind"] == "response" and t["status"] == "completed"]) == 4


def test_lines_are_ndjson_one_object_each(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token")
    status, kind, lines = _lines(f"{headless.url}/api/generate", {"model": NAME, "prompt": "Count"},
                                 {"Authorization": f"Bearer {headless.token}"})
    assert status == 200 and kind == "application/x-ndjson"
    objects = [json.loads(line) for line in lines]
    assert all(o["model"] == NAME and o["created_at"].endswith("Z") for o in objects)
    assert objects[-1]["done"] is True and objects[-1]["done_reason"] == "stop"
    for field in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                  "eval_duration"):
        assert isinstance(objects[-1][field], int), field


def test_errors_are_ollamas(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token")
    client = _client(headless)
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="nothing:7b", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404 and "nothing:7b" in missing.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        client.generate(model=NAME, prompt="hi", options={"temperature": 9})
    assert bad.value.status_code == 400 and "options.temperature" in bad.value.error


@pytest.mark.scripted(length=50, pace=50, crash_after=4)
def test_a_failure_mid_stream_is_an_error_line_with_status_200(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token", engine_mode="safe")  # safe: a crash is not retried in another mode
    status, _, lines = _lines(f"{headless.url}/api/chat", {"model": NAME, "messages": [
        {"role": "user", "content": "Count"}]}, {"Authorization": f"Bearer {headless.token}"})
    objects = [json.loads(line) for line in lines]
    assert status == 200 and objects[0]["message"]["content"]
    assert set(objects[-1]) == {"error"} and objects[-1]["error"]


@pytest.mark.scripted(length=5000, pace=20)
def test_leaving_cancels_the_task(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token")
    with socket.create_connection(("127.0.0.1", int(headless.url.rsplit(":", 1)[1]))) as conn:
        body = json.dumps({"model": NAME, "prompt": "Count"}).encode()
        conn.sendall(b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + headless.token.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b'"response"' not in received:  # the headers, then the first line
            received += conn.recv(4096)
    cancelled = wait_until(lambda: [t for t in headless.get("/v1/tasks")[1]["data"] if t["status"] == "cancelled"],
                           30, 0.1, "the task to be cancelled")
    assert len(cancelled) == 1


def test_empty_prompt_loads_and_keep_alive_zero_unloads(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token")
    client = _client(headless)
    loaded = client.generate(model=NAME)
    assert loaded.done and loaded.done_reason == "load" and [m.model for m in client.ps().models] == [NAME]
    unloaded = client.chat(model=NAME, messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload" and client.ps().models == []
    client.generate(model=NAME, prompt="Count", keep_alive="0s")
    assert client.ps().models == []
    client.generate(model=NAME, prompt="Count", keep_alive=-1)
    assert len(client.ps().models) == 1
    with pytest.raises(ollama.ResponseError) as bad:
        client.generate(model=NAME, prompt="hi", keep_alive="soon")
    assert bad.value.status_code == 400


def test_keep_alive_for_a_while_keeps_the_model_that_long_then_lets_it_go(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token")
    client = _client(headless)
    client.generate(model=NAME, prompt="Count", keep_alive="2s")
    [running] = client.ps().models
    left = running.expires_at.timestamp() - time.time()
    assert 0 < left <= 2.5, left  # what ps says is what the app asked, not "never" (no idle time is set)
    # Unloaded by the service's next look at idle models (every 5 s) once the 2 s are over.
    wait_until(lambda: client.ps().models == [], 15, 0.25, "the model to be let go")
    client.generate(model=NAME, prompt="Count", keep_alive="1h")
    assert 3500 < client.ps().models[0].expires_at.timestamp() - time.time() <= 3600


def test_tools_are_called_and_answered(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token")
    client = _client(headless)
    tool = {"type": "function", "function": {"name": "count", "description": "Counts",
                                             "parameters": {"type": "object", "properties": {}}}}
    # The conversation after a call, Ollama's way: the tool message names the function, no ids.
    said = client.chat(model=NAME, tools=[tool], messages=[
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "count", "arguments": {}}}]},
        {"role": "tool", "tool_name": "count", "content": "1, 2"}])
    assert said.message.content
    with pytest.raises(ollama.ResponseError):
        client.chat(model=NAME, messages=[{"role": "tool", "content": "an answer to no call"}])


def test_delete_forgets_the_model_and_keeps_its_file(headless: Headless) -> None:
    headless.start()
    _on(headless, ollama_api="token")
    _, token = pair_sync(headless.url, headless.token, SCOPES, "ollama-python")
    path = headless.get(f"/v1/models/{DEFAULT_MODEL_ID}")[1]["path"]
    assert http(f"{headless.url}/v1/models", "POST", {"path": path, "id": "copy:7b"}, token)[0] == 201
    client = ollama.Client(host=headless.url, headers={"Authorization": f"Bearer {token}"})
    assert {m.model for m in client.list().models} == {NAME, "copy:7b"}
    assert client.delete("copy:7b").status == "success"
    assert {m.model for m in client.list().models} == {NAME} and Path(path).exists()
    with pytest.raises(ollama.ResponseError) as theirs:
        client.delete(NAME)  # registered by the owner, not by this app
    assert theirs.value.status_code == 403


def test_the_open_listener_is_one_client_the_person_turns_off(headless: Headless) -> None:
    headless.start()
    port = free_port()
    _on(headless, ollama_api="open", ollama_port=port)
    url = f"http://127.0.0.1:{port}"
    assert urllib.request.urlopen(url).read() == b"Ollama is running"
    client = ollama.Client(host=url)  # no token: the built-in client
    assert client.chat(model=NAME, messages=[{"role": "user", "content": "Count"}]).message.content
    with pytest.raises(ollama.ResponseError) as refused:
        client.delete(NAME)  # default scopes: generate and read models
    assert refused.value.status_code == 403
    assert http(f"{url}/v1/models", token=headless.token)[0] == 404  # Ollama's routes only there
    clients = headless.get("/v1/clients")[1]["data"]
    assert any(c["id"] == OLLAMA_ID and c["name"] == OLLAMA_NAME for c in clients)
    tasks = headless.get("/v1/tasks")[1]["data"]
    assert tasks and tasks[0]["status"] == "completed"
    # As Ollama, it keeps nothing once answered: the prompt and output leave a minute later.
    assert headless.get(f"/v1/responses/{tasks[0]['response_id']}")[1]["store"] is False
    # Host and Origin as on the main port; Ollama's own default origins allowed.
    assert http(f"{url}/api/tags", headers={"Origin": "http://localhost:3000"})[0] == 200
    assert http(f"{url}/api/tags", headers={"Origin": "vscode-webview://abc"})[0] == 200
    assert http(f"{url}/api/tags", headers={"Origin": "https://evil.example"})[0] == 403
    assert http(f"{url}/api/tags", headers={"Host": "evil.example"})[0] == 421
    # Turned off in one click: revoking the client.
    assert headless.request("DELETE", f"/v1/clients/{OLLAMA_ID}")[0] == 200
    assert headless.get("/v1/settings")[1]["ollama_api"] == "token"
    wait_until(lambda: not _accepts(port), 10, 0.05, "the listener to close")
    assert all(c["id"] != OLLAMA_ID for c in headless.get("/v1/clients")[1]["data"])
    _on(headless, ollama_api="open")  # on again, then the service stops cleanly with it open
    assert _accepts(port) and headless.terminate() == 0


def test_show_names_the_model_file_not_the_folders_it_is_in(headless: Headless) -> None:
    """Ollama writes a path after FROM; ours would tell any app or page on this computer, with no
    token, the user's name and folder layout (the red team's hygiene note): the file's name only."""
    headless.start()
    port = free_port()
    _on(headless, ollama_api="open", ollama_port=port)
    model_file = paths.default_model_file()
    assert model_file is not None
    status, shown = http(f"http://127.0.0.1:{port}/api/show", "POST", {"model": NAME})  # no token
    assert status == 200 and shown["modelfile"] == f"FROM {model_file.name}\n", shown
    assert str(model_file.parent) not in json.dumps(shown)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_a_taken_port_is_refused_clearly(headless: Headless) -> None:
    headless.start()
    with socket.socket() as taken:  # as Ollama itself would hold it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        status, body = headless.request("PATCH", "/v1/settings", {"ollama_api": "open",
                                                                  "ollama_port": taken.getsockname()[1]})
    assert status == 409 and body["error"]["code"] == "port_in_use" and "Ollama" in body["error"]["message"]
    assert headless.get("/v1/settings")[1]["ollama_api"] == "off"
    status, body = headless.request("PATCH", "/v1/settings", {"ollama_scopes": ["admin"]})
    assert status == 400 and body["error"]["param"] == "ollama_scopes"


def test_pull_from_the_hub_then_chat_and_delete(headless: Headless, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`ollama pull hf.co/owner/repo:QUANT` is a durable download (LMSP §13) from the hub (here its
    stand-in on loopback), its progress as Ollama's; the model then answers to that name, and
    deleting it forgets it and leaves the file in the hub's cache."""
    model = paths.default_model_file()
    assert model is not None
    hub = FakeHub({"test-org/SmolLM2-GGUF": {"smollm2-135m.Q8_0.gguf": HubFile(model)}}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    try:
        headless.start()
        _on(headless, ollama_api="token")
        client = _client(headless)
        name = "hf.co/test-org/SmolLM2-GGUF:Q8_0"
        statuses = list(client.pull(name, stream=True))
        assert statuses[0].status == "pulling manifest" and statuses[-1].status == "success"
        progress = [s for s in statuses if s.total]
        assert progress and progress[-1].completed == progress[-1].total == model.stat().st_size
        assert client.pull(name).status == "success"  # again: already there
        said = client.chat(model=name, messages=[{"role": "user", "content": "Count"}])
        assert said.message.content == "1, 2, 3, 4, 5, 6"
        assert "smollm2-135m.q8_0:latest" in {m.model for m in client.list().models}
        with pytest.raises(ollama.ResponseError) as unknown:
            client.pull("llama3.2")  # Ollama's own library is not a source here
        assert unknown.value.status_code == 400 and "hf.co/" in unknown.value.error
        assert client.delete(name).status == "success"
        assert "smollm2-135m.q8_0:latest" not in {m.model for m in client.list().models}
        assert list((tmp_path / "hf").rglob("smollm2-135m.Q8_0.gguf"))  # the file stays
    finally:
        hub.stop()


async def test_each_app_without_a_token_has_its_part_of_the_shared_limits(service: Any) -> None:
    """The red team's P3: every app without a token is the one built-in client, and one of them
    used up its limits for all (256 MiB of failed 8 MB prompts: 429 to every Ollama app, with
    Retry-After 7 days). Each may now use a quarter of them, and what it stored is gone, and no
    longer counted, a minute after its task ends."""
    await service.settings.update({"ollama_api": "open", "max_request_bytes_per_client": 4 << 20,
                                   "max_queued_tasks_per_client": 8})
    await service.access.open_ollama()
    service.tasks.set_paused(True)  # the tasks stay queued: unfinished, their requests stored
    shared = service.access.tokenless()
    assert shared is not None
    one, other = (dataclasses.replace(shared, party=party) for party in ("process 1", "process 2"))
    prompt = {"input": "x" * (600 << 10), "max_output_tokens": 1, "store": False}
    created = await service.responses.create_response(one, prompt)  # 0.6 MiB of its 1
    with pytest.raises(TooManyRequests) as refused:
        await service.responses.create_response(one, prompt)
    assert refused.value.code == "storage_limit_reached" and "This app's" in refused.value.message
    await service.responses.create_response(one, {**prompt, "input": "Say hi"})  # its second of 8 / 4 in the queue
    with pytest.raises(TooManyRequests) as queued:
        await service.responses.create_response(one, {**prompt, "input": "Say hi"})
    assert queued.value.code == "too_many_queued_tasks" and "This app" in queued.value.message
    await service.responses.create_response(other, prompt)  # the other app has its own part
    await service.tasks.cancel(shared, "task", created.body["task"]["id"])
    with pytest.raises(TooManyRequests) as ended:
        await service.responses.create_response(one, prompt)
    wait = int(ended.value.headers["Retry-After"])
    assert 30 <= wait <= 90, wait  # not the retention period: a store: false request is purged after a minute
    await service.store.write(retention.purge_unstored, time.time() + 61)
    service.tasks.set_paused(False)
    await service.responses.create_response(one, prompt)


async def test_each_app_without_a_token_is_an_app_of_its_own_to_models_and_slots(api: Any, service: Any) -> None:
    """The apps without a token are one client, but each is an app of its own where apps are told
    apart: one cannot unload (`keep_alive` 0) a model only another of them used (red team P4), and
    they take turns for slots as paired apps do (P7)."""
    await service.settings.update({"ollama_api": "open"})
    await service.access.open_ollama()
    shared = service.access.tokenless()
    assert shared is not None
    one, other = (dataclasses.replace(shared, party=party) for party in ("process 1", "process 2"))
    assert one.app != other.app and one.id == other.id
    created = await service.responses.create_response(other, {"input": "Count", "max_output_tokens": 3,
                                                               "background": True})
    await wait_status(api, created.body["task"]["id"])
    await service.models.keep_loaded(DEFAULT_MODEL_ID, 0, one)  # only the other app used it
    assert (await service.models.model(DEFAULT_MODEL_ID))["status"] == "loaded"
    await service.models.keep_loaded(DEFAULT_MODEL_ID, 0, other)  # its own use alone: unloaded
    assert (await service.models.model(DEFAULT_MODEL_ID))["status"] != "loaded"


def test_keep_alive_is_finite_and_at_most_a_year_and_ps_always_answers(headless: Headless) -> None:
    """Red team P5: `keep_alive` 1e12 pinned the model and made /api/ps answer 500 to every app
    (a date past year 9999); "nan" pinned it for good while /api/ps said it expired now."""
    headless.start()
    _on(headless, ollama_api="token")
    _, token = pair_sync(headless.url, headless.token, SCOPES, "ollama-python")
    client = ollama.Client(host=headless.url, headers={"Authorization": f"Bearer {token}"})
    for bad in (1e12, "1e12", "nan", "NaN", "inf", "-inf", "Infinity", 365 * 86400 + 1, "8761h", "1" * 400 + "h",
                "1" * 100 + "x", True, [], {"s": 1}):
        status, body = http(f"{headless.url}/api/generate", "POST", {"model": NAME, "keep_alive": bad}, token)
        assert status == 400 and "keep_alive" in body["error"] and "365 days" in body["error"], (bad, body)
    assert client.ps().models == []  # none of them loaded the model
    year = 365 * 86400
    for good, left in ((year, year), ("8760h", year), ("1h30m", 5400), ("5m", 300), ("90", 90), (-1, 100 * year),
                       ("-1m", 100 * year)):
        assert client.generate(model=NAME, keep_alive=good).done_reason == "load"
        [running] = client.ps().models  # never a 500, whatever the expiry
        assert abs(running.expires_at.timestamp() - time.time() - left) < 120, (good, running.expires_at)


def test_pinning_and_unloading_are_models_write_powers(headless: Headless) -> None:
    """Red team P4: with `responses:write` alone an app pinned a model for good (`keep_alive: -1`)
    and unloaded it from under the other apps (`keep_alive: 0`); on /v1 both need `models:write`."""
    headless.start()
    _on(headless, ollama_api="token", model_idle_ttl_seconds=2)
    writer, modeler = _client(headless, ["models:read", "responses:write"]), _client(headless)
    # With responses:write alone, the model stays loaded the idle time, no longer.
    writer.generate(model=NAME, prompt="Count", keep_alive=-1)
    [running] = writer.ps().models
    assert running.expires_at.timestamp() - time.time() <= 2.5
    wait_until(lambda: writer.ps().models == [], 15, 0.25, "the idle time to let the model go")
    # With models:write, as long as the app says.
    modeler.generate(model=NAME, prompt="Count", keep_alive=-1)
    time.sleep(7)  # past the idle time and the service's next look at idle models (every 5 s)
    assert [m.model for m in writer.ps().models] == [NAME]
    assert writer.generate(model=NAME, keep_alive=0).done_reason == "unload"  # Ollama's answer...
    assert [m.model for m in writer.ps().models] == [NAME]  # ... but it is another app's to unload
    assert modeler.generate(model=NAME, keep_alive=0).done_reason == "unload" and writer.ps().models == []
    # Without an idle time, a model is the others' once they used it since it was loaded.
    _on(headless, model_idle_ttl_seconds=0)
    writer.generate(model=NAME, prompt="Count")
    writer.generate(model=NAME, prompt="Count", keep_alive=0)  # its own use alone: unloaded
    assert writer.ps().models == []
    _, other = pair_sync(headless.url, headless.token, ["responses:write"], "Another App")
    assert http(f"{headless.url}/v1/responses", "POST", {"input": "Count", "max_output_tokens": 3}, other)[0] == 200
    writer.generate(model=NAME, prompt="Count", keep_alive=0)
    assert [m.model for m in writer.ps().models] == [NAME]
    modeler.generate(model=NAME, keep_alive=0)
    assert writer.ps().models == []


def test_an_empty_prompt_without_models_write_evicts_no_model(headless: Headless, tmp_path: Path) -> None:
    """Red team P4: with one engine, an empty prompt for another model swapped the engine to it,
    evicting the model the other apps used. Without `models:write` it loads a model only on an
    engine that holds none; otherwise the model loads with the app's first request, in its turn."""
    headless.start()
    _on(headless, ollama_api="token")
    other = tmp_path / "Other.gguf"
    shutil.copyfile(headless.get(f"/v1/models/{DEFAULT_MODEL_ID}")[1]["path"], other)
    assert headless.request("POST", "/v1/models", {"path": str(other), "id": "other"})[0] == 201
    writer, modeler = _client(headless, ["models:read", "responses:write"]), _client(headless)
    assert writer.generate(model=NAME).done_reason == "load"  # the engine held nothing: loaded
    assert [m.model for m in writer.ps().models] == [NAME]
    assert writer.generate(model="other").done_reason == "load"  # Ollama's answer, and nothing evicted
    assert [m.model for m in writer.ps().models] == [NAME]
    assert writer.generate(model="other", prompt="Count").response
    assert [m.model for m in writer.ps().models] == ["other:latest"]
    assert modeler.generate(model=NAME).done_reason == "load"  # models:write: the engine is swapped
    assert [m.model for m in writer.ps().models] == [NAME]


@pytest.mark.scripted(pace=20, load_seconds=1.0)
def test_an_unload_loop_without_models_write_does_not_slow_other_apps(headless: Headless) -> None:
    """Red team P4: a tokenless process sending `keep_alive: 0` every 0.3 s made another app's
    3-token requests 12 times slower (each reloaded the model; here a load takes 1 s)."""
    headless.start()
    port = free_port()
    _on(headless, ollama_api="open", ollama_port=port)  # tokenless: models:read and responses:write
    listener = f"http://127.0.0.1:{port}"
    _, victim = pair_sync(headless.url, headless.token, ["responses:write"], "Another App")

    def mean_latency(count: int = 10) -> float:
        took = []
        for _ in range(count):
            started = time.monotonic()
            status, body = http(f"{headless.url}/v1/responses", "POST", {"input": "Say one word.",
                                                                         "max_output_tokens": 3}, victim)
            took.append(time.monotonic() - started)
            assert status == 200, body
            time.sleep(0.2)
        return sum(took) / count

    assert http(f"{listener}/api/generate", "POST", {"model": NAME})[1]["done_reason"] == "load"
    alone = mean_latency()
    stop, answers = threading.Event(), []

    def unload_loop() -> None:
        while not stop.is_set():
            answers.append(http(f"{listener}/api/generate", "POST", {"model": NAME, "keep_alive": 0})[1])
            stop.wait(0.3)

    loop = threading.Thread(target=unload_loop)
    loop.start()
    try:
        beside = mean_latency()
    finally:
        stop.set()
        loop.join()
    print(f"\nanother app's mean 3-token latency: alone {alone:.3f} s, beside {len(answers)} unloads {beside:.3f} s")
    assert len(answers) > 10 and all(a.get("done_reason") == "unload" for a in answers), answers[:3]
    assert beside <= 1.2 * alone, (alone, beside)
