"""Benchmarks of engine safe mode (LMSP §11), `make bench`: what safe mode costs in decode speed
(bare llama-cpp-python, both modes, same run), what the warm-up adds to a first load, and how
long a task waits between a crash in fast mode and its next text in safe mode."""

from __future__ import annotations

import logging
import re
import statistics
import time

import pytest

from app.core.service import AppService
from app.engine.child import backend
from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.bench.test_throughput import PROMPT, bare_tokens_per_second, fast_works


def test_decode_speed_fast_vs_safe() -> None:
    safe = bare_tokens_per_second(fast=False)
    variant = backend.loaded_variant() or "native"
    if not fast_works():
        print(f"\n[bench] decode, bare llama-cpp-python ({variant} CPU backend): fast mode crashes on this CPU; "
              f"safe {safe:.1f} tokens/s")
        return
    fast = bare_tokens_per_second(fast=True)
    print(f"\n[bench] decode, bare llama-cpp-python ({variant} CPU backend): "
          f"fast {fast:.1f} tokens/s, safe {safe:.1f} tokens/s; safe / fast = {safe / fast:.3f}")


async def timed_load(service: AppService) -> float:
    """A first load in a fresh engine process, in seconds."""
    await service.pool.engines[0].stop()
    started = time.perf_counter()
    await service.models.load_model(DEFAULT_MODEL_ID)
    return time.perf_counter() - started


async def test_warm_up_time_on_first_load(service: AppService, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    if not fast_works():  # `auto` on this CPU: fast, its warm-up crashes, safe; then safe is remembered
        first, later = await timed_load(service), statistics.median([await timed_load(service) for _ in range(3)])
        print(f"\n[bench] first load where fast mode crashes (auto: fast, crash in the warm-up, safe): "
              f"{first * 1000:.0f} ms; later loads (safe remembered), median of 3: {later * 1000:.0f} ms")
        return
    loads: dict[str, list[float]] = {"fast": [], "safe": []}
    for _ in range(3):
        for mode in ("fast", "safe"):
            await service.settings.update({"engine_mode": mode})
            loads[mode].append(await timed_load(service))
    warmups = [float(r.getMessage().split("(warm-up ")[1].split(" s")[0]) for r in caplog.records
               if "(warm-up " in r.getMessage() and "in fast mode" in r.getMessage()]
    fast, safe = statistics.median(loads["fast"]), statistics.median(loads["safe"])
    print(f"\n[bench] first load with a fresh process, median of 3: fast (with warm-up) {fast * 1000:.0f} ms, "
          f"safe (none) {safe * 1000:.0f} ms; the warm-up itself {statistics.median(warmups) * 1000:.0f} ms")


async def test_fallback_time_from_crash_to_text(service: AppService, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    owner = await service.access.authenticate(await service.access.owner_token())
    assert owner is not None
    arrivals: list[float] = []
    service.bus.listen(lambda e: arrivals.append(time.time()) if e["type"] == "response.output_text.delta" else None)
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:token20")
    body = {"input": PROMPT, "background": True, "max_output_tokens": 60, "temperature": 0}
    created = await service.responses.create_response(owner, body)
    row = await service.tasks.wait(created.body["task"]["id"])
    assert row["status"] == "completed"
    # Where fast mode really crashes (this CPU's own fault, in the warm-up), that crash is the one timed.
    crash = next(r for r in caplog.records if "killed by SIG" in r.getMessage())
    resumed = next(t for t in arrivals if t > crash.created)
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
    how = re.search(r"killed by (\S+) while (.+?) /", crash.getMessage())
    print(f"\n[bench] {how[1]} while {how[2]} in fast mode -> next text in safe mode: "
          f"{(resumed - crash.created) * 1000:.0f} ms "
          f"(fresh process, model load, context rebuilt from the committed tokens); "
          f"median gap between deltas otherwise {statistics.median(gaps) * 1000:.0f} ms")
