"""Engine safe mode (LMSP §11): an engine that crashes in llama.cpp's fast CPU paths carries on
in safe mode, remembers it, and says so; a model that crashes even in safe mode fails its task
and nothing loops.

The crashes are real: LMSP_ENGINE_FAULT, read only by the engine (app/engine/parent/faults.py),
kills its llama-server with SIGSEGV at a chosen point, as llama.cpp's AMX kernels do on some Intel CPUs. Without it,
on a CPU whose fast paths really crash, the same code paths run (the warm-up finds it)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from app.core.service import AppService
from app.engine.parent import cpu
from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.helpers import SAY_HI, expect_error
from tests.test_api import check_sequence, deltas, events, start_background, wait_status
from tests.test_gguf import T, make_gguf

# A model's `engine` in GET /v1/models: fast mode, and the GPU (LMSP §18) never turned off by it.
IN_FAST_MODE = {"mode": "fast", "reason": None, "gpu": "auto", "gpu_reason": None}
SLOW = 300.0  # a fresh process, a model load and a rebuilt context, on a machine that may be busy
LONGER = {"input": "Write the numbers from 1 to 1000 separated by commas.", "max_output_tokens": 60, "temperature": 0}


async def default_engine(api: Any) -> dict[str, Any]:
    resp = await api.get(f"/v1/models/{DEFAULT_MODEL_ID}")
    assert resp.status == 200, await resp.text()
    return (await resp.json())["engine"]


def processes_started(caplog: pytest.LogCaptureFixture) -> int:
    return sum("started inference process" in r.getMessage() for r in caplog.records)


@pytest.fixture
def bus_events(service: AppService) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    service.bus.listen(seen.append)
    return seen


async def test_a_crash_at_warm_up_falls_back_to_safe_mode_and_the_task_completes(
        api: Any, service: AppService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        bus_events: list[dict[str, Any]]) -> None:
    assert await default_engine(api) == IN_FAST_MODE
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:warmup")
    caplog.set_level(logging.INFO)
    resp = await api.post("/v1/responses", json=SAY_HI)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["status"] in ("completed", "incomplete") and body["output_text"].strip()

    engine = await default_engine(api)
    assert engine["mode"] == "safe" and "SIGSEGV" in engine["reason"] and "safe mode" in engine["reason"]
    assert service.pool.engines[0].mode == "safe"
    # Said once, in plain words, for the model that crashed.
    notices = [e for e in bus_events if e["type"] == "engine.safe_mode"]
    assert len(notices) == 1 and notices[0]["models"] == [DEFAULT_MODEL_ID]
    # The log has what a bug report needs: the signal, the model file, the CPU and its flags.
    crash = next(r.getMessage() for r in caplog.records if "killed by SIGSEGV" in r.getMessage())
    assert "warming up" in crash and service.pool.engines[0].model_path in crash and cpu.describe()[0] in crash
    assert processes_started(caplog) == 2  # the one that crashed, the safe one

    # Later tasks run in safe mode on the same process: no crash, no new notice.
    resp = await api.post("/v1/responses", json=SAY_HI)
    assert resp.status == 200
    assert processes_started(caplog) == 2
    assert len([e for e in bus_events if e["type"] == "engine.safe_mode"]) == 1


async def test_a_crash_mid_task_continues_the_same_attempt_without_losing_output(
        api: Any, service: AppService, monkeypatch: pytest.MonkeyPatch) -> None:
    # The warm-up passes; the task's 20th token kills the process (a shape-dependent crash).
    # Armed before the engine process starts: it reads its environment once.
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:token20")
    # What an uninterrupted run gives, in safe mode (the kernels the fallback ends on).
    resp = await api.patch("/v1/settings", json={"engine_mode": "safe"})
    assert resp.status == 200, await resp.text()
    reference = await (await api.post("/v1/responses", json=LONGER)).json()
    resp = await api.patch("/v1/settings", json={"engine_mode": "auto"})
    assert resp.status == 200

    created = await start_background(api, LONGER)
    task_id = created["task"]["id"]
    done = await wait_status(api, task_id, {"completed", "failed", "cancelled"}, timeout=SLOW)
    assert done["status"] == "completed", done
    evs = await events(api, task_id)
    check_sequence(evs)
    assert {e["attempt"] for e in evs} == {1}
    assert not any(e.get("output_reset") for e in evs)
    assert not any(e["type"] == "response.failed" for e in evs)
    final = await (await api.get(f"/v1/responses/{created['id']}")).json()
    assert final["output_text"] == deltas(evs)
    assert done["progress"]["output_tokens"] == LONGER["max_output_tokens"]
    if not {"amx_tile", "amx_int8"} & cpu.describe()[1]:
        # Q4_1 takes the same kernels in both modes on CPUs without AMX: the text that was
        # committed before the crash and the text after it join exactly.
        assert final["output_text"] == reference["output_text"]
    assert (await default_engine(api))["mode"] == "safe"


async def test_safe_mode_is_remembered_across_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:warmup")
    first = AppService(tmp_path / "data")
    await first.start()
    try:
        await first.models.load_model(DEFAULT_MODEL_ID)
        assert (await first.models.model(DEFAULT_MODEL_ID))["engine"]["mode"] == "safe"
    finally:
        await first.stop()

    caplog.clear()
    second = AppService(tmp_path / "data")
    await second.start()
    try:
        engine = (await second.models.model(DEFAULT_MODEL_ID))["engine"]
        assert engine["mode"] == "safe" and "SIGSEGV" in engine["reason"]
        # With the fault still armed, loading goes straight to safe mode: one process, no crash.
        await second.models.load_model(DEFAULT_MODEL_ID)
        assert second.pool.engines[0].mode == "safe"
        assert processes_started(caplog) == 1
        assert not any("killed by" in r.getMessage() for r in caplog.records)
    finally:
        await second.stop()


async def test_two_crashes_in_safe_mode_fail_the_task_and_the_next_task_gets_a_fresh_engine(
        api: Any, service: AppService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "any:prompt")  # this model cannot run at all
    created = await start_background(api, SAY_HI)
    done = await wait_status(api, created["task"]["id"], {"completed", "failed", "cancelled"}, timeout=SLOW)
    assert done["status"] == "failed" and done["error"]["code"] == "engine_crashed", done
    assert "even in safe mode" in done["error"]["message"]
    evs = await events(api, created["task"]["id"])
    check_sequence(evs)
    assert [e["type"] for e in evs].count("response.failed") == 1
    # fast (crashed) -> safe (crashed) -> safe once more (crashed): then it stops.
    assert processes_started(caplog) == 3
    assert not service.pool.engines[0].alive

    monkeypatch.delenv("LMSP_ENGINE_FAULT")  # the next task: a fresh engine, and it works
    resp = await api.post("/v1/responses", json=SAY_HI)
    assert resp.status == 200 and (await resp.json())["output_text"].strip()
    assert processes_started(caplog) == 4
    assert (await api.get("/health")).status == 200


async def test_an_engine_killed_between_requests_is_replaced_without_failing_the_next(
        api: Any, service: AppService, caplog: pytest.LogCaptureFixture) -> None:
    """As the kernel's out-of-memory killer does to the biggest process; no request was running."""
    caplog.set_level(logging.INFO)
    assert (await api.post("/v1/responses", json=SAY_HI)).status == 200
    engine = service.pool.engines[0]
    assert engine.pid is not None
    # Two where fast mode crashes on this CPU (AMX): the first load is retried in safe mode.
    before = processes_started(caplog)
    os.kill(engine.pid, signal.SIGKILL)
    while engine.alive:
        await asyncio.sleep(0.01)
    resp = await api.post("/v1/responses", json=SAY_HI)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["output_text"].strip()
    assert processes_started(caplog) == before + 1


async def test_engine_mode_setting(api: Any, service: AppService, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    resp = await api.patch("/v1/settings", json={"engine_mode": "turbo"})
    await expect_error(resp, 400, "invalid_request", "engine_mode")
    assert (await (await api.get("/v1/settings")).json())["engine_mode"] == "auto"

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:warmup")
    # `fast` is obeyed: the crash fails the task, and the message says what to change.
    assert (await api.patch("/v1/settings", json={"engine_mode": "fast"})).status == 200
    err = await expect_error(await api.post("/v1/responses", json=SAY_HI), 500, "engine_crashed")
    assert "engine_mode" in err["message"] and err["type"] == "server_error"
    assert (await default_engine(api))["mode"] == "fast"  # nothing remembered: the user chose

    # `safe` is obeyed from the first load: no crash at all.
    assert (await api.patch("/v1/settings", json={"engine_mode": "safe"})).status == 200
    assert await default_engine(api) == {**IN_FAST_MODE, "mode": "safe",
                                         "reason": "Chosen in the settings (engine_mode)."}
    before = processes_started(caplog)
    resp = await api.post("/v1/responses", json=SAY_HI)
    assert (await resp.json())["output_text"].strip()
    assert processes_started(caplog) == before + 1 and service.pool.engines[0].mode == "safe"


async def test_a_model_llama_cpp_cannot_load_leaves_the_others_usable(api: Any, service: AppService,
                                                                      tmp_path: Path) -> None:
    # A file our validator accepts but llama.cpp cannot load: magic, version 3, an architecture,
    # one 8-byte tensor (issue: the failed load used to break every later task).
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(make_gguf({"general.architecture": "llama"}, [T("w", (2,))]))
    resp = await api.post("/v1/models", json={"path": str(bad), "id": "broken"})
    assert resp.status in (200, 201), await resp.text()

    assert (await (await api.post("/v1/responses", json=SAY_HI)).json())["output_text"].strip()
    await expect_error(await api.post("/v1/responses", json={**SAY_HI, "model": "broken"}), 422, "model_load_failed")
    listed = {m["id"]: m["status"] for m in (await (await api.get("/v1/models")).json())["data"]}
    assert listed[DEFAULT_MODEL_ID] != "loaded"  # the registry says what the engine really holds
    body = await (await api.post("/v1/responses", json=SAY_HI)).json()
    assert body["status"] in ("completed", "incomplete") and body["output_text"].strip(), body
    resp = await api.post("/v1/models/broken/load")
    await expect_error(resp, 422, "model_load_failed")
    resp = await api.post(f"/v1/models/{DEFAULT_MODEL_ID}/load")
    assert resp.status == 200 and (await resp.json())["status"] == "loaded"


def test_the_fault_switch_is_read_in_one_place_only() -> None:
    """Nothing but the engine's fault injection reads it: a user's environment never makes it crash."""
    root = Path(__file__).resolve().parent.parent / "app"
    readers = [str(p.relative_to(root)) for p in root.rglob("*.py") if "LMSP_ENGINE_FAULT" in p.read_text()]
    assert readers == ["engine/parent/faults.py"]
    assert "LMSP_ENGINE_FAULT" not in os.environ


async def test_a_chat_stream_that_fails_after_its_first_words_ends_with_an_error_chunk(
        api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every attempt dies at its third token, fast and safe: the task fails once two are out.
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "any:token3")
    resp = await api.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 30, "stream": True})
    assert resp.status == 200 and resp.content_type == "text/event-stream"  # the words came: a stream
    payloads = [line[len("data: "):] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    said = "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-2])
    assert said.strip(), payloads  # the words before the crash
    error = json.loads(payloads[-2])["error"]  # the openai SDK raises an APIError for it
    assert error["code"] == "engine_crashed" and error["type"] == "server_error", error
