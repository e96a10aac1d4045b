"""Benchmarks of engine safe mode (LMSP §11), `make bench`: what safe mode costs in decode speed
(bare llama-cpp-python, both modes, same run), what the warm-up adds to a first load, and how
long a task waits between a crash in fast mode and its next text in safe mode."""

from __future__ import annotations

import logging
import os
import statistics
import time

import pytest

from app import paths
from app.core.service import AppService
from app.engine import backend
from app.engine.child import extra_bufts
from app.engine.models import DEFAULT_MODEL_ID

PROMPT = "Write a detailed essay about the history of lighthouses."
TOKENS = 200


def decode_tokens_per_second(fast: bool) -> float:
    """Plain llama-cpp-python (the engine's settings: n_ctx 4096, every core), best of 3."""
    from llama_cpp import Llama

    backend.load()
    with extra_bufts(fast):
        llm = Llama(model_path=str(paths.default_model_file()), n_ctx=4096, n_threads=os.cpu_count(), verbose=False)
    llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        out = llm.create_chat_completion([{"role": "user", "content": PROMPT}], max_tokens=TOKENS, temperature=0)
        best = max(best, out["usage"]["completion_tokens"] / (time.perf_counter() - start))
    return best


def test_decode_speed_fast_vs_safe() -> None:
    fast = decode_tokens_per_second(True)
    safe = decode_tokens_per_second(False)
    print(f"\n[bench] decode, bare llama-cpp-python ({backend.loaded_variant() or 'native'} CPU backend): "
          f"fast {fast:.1f} tokens/s, safe {safe:.1f} tokens/s; safe / fast = {safe / fast:.3f}")


async def test_warm_up_time_on_first_load(service: AppService, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    loads: dict[str, list[float]] = {"fast": [], "safe": []}
    for _ in range(3):
        for mode in ("fast", "safe"):
            await service.update_settings({"engine_mode": mode})
            await service.engines[0].stop()
            started = time.perf_counter()
            await service.load_model(DEFAULT_MODEL_ID)
            loads[mode].append(time.perf_counter() - started)
    warmups = [float(r.getMessage().split("(warm-up ")[1].split(" s")[0]) for r in caplog.records
               if "(warm-up " in r.getMessage() and "in fast mode" in r.getMessage()]
    fast, safe = statistics.median(loads["fast"]), statistics.median(loads["safe"])
    print(f"\n[bench] first load with a fresh process, median of 3: fast (with warm-up) {fast * 1000:.0f} ms, "
          f"safe (none) {safe * 1000:.0f} ms; the warm-up itself {statistics.median(warmups) * 1000:.0f} ms")


async def test_fallback_time_from_crash_to_text(service: AppService, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    owner = await service.authenticate(await service.owner_token())
    assert owner is not None
    arrivals: list[float] = []
    service.bus.listen(lambda e: arrivals.append(time.time()) if e["type"] == "response.output_text.delta" else None)
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:token20")
    created = await service.create_response(owner, {"input": PROMPT, "background": True, "max_output_tokens": 60,
                                                    "temperature": 0})
    row = await service.wait(created.body["task"]["id"])
    assert row["status"] == "completed"
    crashed = next(r.created for r in caplog.records if "killed by SIGSEGV" in r.getMessage())
    resumed = next(t for t in arrivals if t > crashed)
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
    print(f"\n[bench] crash in fast mode -> next text in safe mode: {(resumed - crashed) * 1000:.0f} ms "
          f"(fresh process, model load, context rebuilt from the committed tokens); "
          f"median gap between deltas otherwise {statistics.median(gaps) * 1000:.0f} ms")
