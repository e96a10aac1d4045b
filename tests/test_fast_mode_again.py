"""Safe mode only for what it can fix, and a way back (red team 2026-12-05, N1; LMSP §11).

A request's grammar that runs out of ways to continue no longer kills the engine (llama-server
catches it): an unsatisfiable schema never moves the model to safe mode. A crash in the kernels,
SIGABRT included (a GGML_ASSERT), still falls back, even in a task with a grammar. A remembered
fallback applies only under the llama.cpp release it was made under, and the person can forget it
(DELETE /v1/models/{id}/engine-mode); tests/gui/test_models_fast_mode.py does it from the Models tab.

Crashes are real (LMSP_ENGINE_FAULT: the engine kills its llama-server by the signal named, at the
point named; see app/engine/parent/faults.py), and so is an unsatisfiable schema. The
model is the default one requantized (`fast_model`): fast mode runs it on every CPU, those where
the default model's fast mode crashes (AMX) included."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from app import paths
from app.core.service import AppService
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.server.app import make_app
from tests.helpers import SAY_HI, expect_error, started
from tests.test_api import wait_status
from tests.test_engine_modes import IN_FAST_MODE, SLOW, bus_events, processes_started  # noqa: F401

NAME = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
FAST = "smollm2-q5"  # the model `fast_model` makes


def structured(schema: dict[str, Any], tokens: int = 24) -> dict[str, Any]:
    return {"model": FAST, "input": "Give a name for a cat.", "max_output_tokens": tokens, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}


async def engine_of(service: AppService) -> dict[str, Any]:
    return (await service.models.model(FAST))["engine"]


@pytest.fixture
async def fast(service: AppService, fast_model: Path) -> str:
    await service.models.register_model({"path": str(fast_model), "id": FAST})
    return FAST


async def remembered(service: AppService) -> list[tuple[str, str | None]]:
    """What the next start reads: each model's remembered mode, with the release it was decided under."""
    return await service.store.read(
        lambda c: [(r["mode"], r["llama"]) for r in c.execute("SELECT mode, llama FROM engine_modes")])


async def test_an_unsatisfiable_schema_never_moves_the_model_to_safe_mode(
        api: Any, service: AppService, fast: str, caplog: pytest.LogCaptureFixture) -> None:
    """The red team's request, as sent: a string that must be one NUL. It aborted llama.cpp (SIGABRT)
    three times per request and left the model in safe mode for good. Whatever the answer is
    (a refusal of the schema, or a failed task), the model keeps fast mode and the next works."""
    caplog.set_level(logging.INFO)
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": "^\\u0000$"}}, "required": ["v"]}
    await api.post("/v1/responses", json={**structured(schema, tokens=8), "input": "Write v."})
    assert processes_started(caplog) <= 1  # was 3: fast, then safe twice
    assert await engine_of(service) == IN_FAST_MODE
    assert await remembered(service) == []
    resp = await api.post("/v1/responses", json={**SAY_HI, "model": FAST})
    assert resp.status == 200 and (await resp.json())["output_text"].strip()
    assert service.pool.engines[0].mode == "fast"


async def test_a_kernel_abort_while_a_grammar_is_in_use_still_falls_back(
        api: Any, service: AppService, fast: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A GGML_ASSERT in fast mode's repacked kernels, at the third token of a structured answer:
    # the kernels' crash, not the grammar's. The task carries on in safe mode, still valid JSON.
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:token3:SIGABRT")
    created = await (await api.post("/v1/responses", json={**structured(NAME), "background": True})).json()
    done = await wait_status(api, created["task"]["id"], {"completed", "failed", "cancelled"}, timeout=SLOW)
    assert done["status"] == "completed", done
    final = await (await api.get(f"/v1/responses/{created['id']}")).json()
    assert json.loads(final["output_text"])["name"]
    engine = await engine_of(service)
    assert engine["mode"] == "safe" and "SIGABRT" in engine["reason"]
    assert await remembered(service) == [("safe", paths.LLAMA_CPP)]


async def test_try_fast_mode_again_through_the_api_and_after_a_restart(
        tmp_path: Path, fast_model: Path, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:warmup")  # fast mode crashes, as on an AMX CPU
    async with started(data) as first:
        await first.models.register_model({"path": str(fast_model), "id": FAST})
        await first.models.load_model(FAST)
        assert (await engine_of(first))["mode"] == "safe"

    monkeypatch.delenv("LMSP_ENGINE_FAULT")  # llama.cpp got fixed, say
    caplog.set_level(logging.INFO)
    async with started(data) as second:
        api = await aiohttp_client(make_app(second))
        api.session.headers["Authorization"] = f"Bearer {await second.access.owner_token()}"
        assert (await engine_of(second))["mode"] == "safe"  # remembered across the restart
        assert (await (await api.post(f"/v1/models/{FAST}/load")).json())["status"] == "loaded"
        seen: list[dict[str, Any]] = []
        second.bus.listen(seen.append)

        resp = await api.delete(f"/v1/models/{FAST}/engine-mode")
        assert resp.status == 200, await resp.text()
        model = await resp.json()
        assert model["engine"] == IN_FAST_MODE
        assert model["status"] == "available"  # the engine let go of it in safe mode
        assert {"type": "models.changed"} in seen
        listed = {m["id"]: m for m in (await (await api.get("/v1/models")).json())["data"]}
        assert listed[FAST]["engine"]["mode"] == "fast"
        await expect_error(await api.delete("/v1/models/no-such-model/engine-mode"), 404, "not_found")

        before = processes_started(caplog)
        resp = await api.post("/v1/responses", json={**SAY_HI, "model": FAST})
        assert resp.status == 200 and (await resp.json())["output_text"].strip()
        # A server started for fast mode (the safe one was let go): it runs, nothing crashes.
        assert second.pool.engines[0].mode == "fast" and processes_started(caplog) == before + 1
        assert await remembered(second) == []
        # Asking again changes nothing, and says so the same way.
        resp = await api.delete(f"/v1/models/{FAST}/engine-mode")
        assert resp.status == 200 and (await resp.json())["engine"]["mode"] == "fast"

    async with started(data) as third:
        assert await engine_of(third) == IN_FAST_MODE


@pytest.mark.parametrize("release", ["0.2.90", None], ids=["older release", "before releases were kept"])
async def test_safe_mode_decided_under_another_llama_cpp_is_not_applied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        release: str | None) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:warmup")
    async with started(data) as first:
        await first.models.load_model(DEFAULT_MODEL_ID)
        assert await remembered(first) == [("safe", paths.LLAMA_CPP)]
    with sqlite3.connect(data / paths.DB_NAME) as db:
        db.execute("UPDATE engine_modes SET llama = ?", (release,))
    db.close()

    caplog.set_level(logging.INFO)
    caplog.clear()  # count the second service's engine starts only (the level may be INFO already)
    async with started(data) as second:
        assert (await second.models.model(DEFAULT_MODEL_ID))["engine"] == IN_FAST_MODE
        # Fast mode gets its chance; here it still crashes, so the engine falls back again,
        # now under this release.
        await second.models.load_model(DEFAULT_MODEL_ID)
        assert second.pool.engines[0].mode == "safe" and processes_started(caplog) == 2
        assert await remembered(second) == [("safe", paths.LLAMA_CPP)]
