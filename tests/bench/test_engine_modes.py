"""Benchmarks of engine safe mode (LMSP §11), `make bench`: what safe mode costs in decode speed
(a bare llama-server, tests/bench/bare.py, in both modes: `--repack` and `--no-repack`, same run),
how long a first load takes in each, and how long a task waits between a crash in fast mode and
its next text in safe mode."""

from __future__ import annotations

import logging
import re
import statistics
import time
from pathlib import Path

import pytest

from app.core.service import AppService
from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.bench.bare import bare, fast_works
from tests.bench.test_streaming import server_timed_decode
from tests.bench.test_throughput import PROMPT
from tests.conftest import Processes


def test_decode_speed_fast_vs_safe(procs: Processes, tmp_path: Path) -> None:
    def rate(safe: bool) -> float:
        peer = bare(procs, tmp_path / f"bare-{'safe' if safe else 'fast'}.log", parallel=1, safe=safe)
        try:
            return statistics.median(server_timed_decode(peer) for _ in range(3))
        finally:
            peer.kill()

    safe = rate(True)
    if not fast_works():
        print(f"\n[bench] decode, bare llama-server: fast mode crashes on this CPU; safe {safe:.1f} tokens/s")
        return
    fast = rate(False)
    print(f"\n[bench] decode, bare llama-server: fast {fast:.1f} tokens/s, safe {safe:.1f} tokens/s; "
          f"safe / fast = {safe / fast:.3f}")


async def timed_load(service: AppService) -> float:
    """A first load in a fresh llama-server, in seconds."""
    await service.pool.engines[0].stop()
    started = time.perf_counter()
    await service.models.load_model(DEFAULT_MODEL_ID)
    return time.perf_counter() - started


async def test_first_load_in_each_mode(service: AppService) -> None:
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
    fast, safe = statistics.median(loads["fast"]), statistics.median(loads["safe"])
    print(f"\n[bench] first load with a fresh llama-server, median of 3: fast {fast * 1000:.0f} ms, "
          f"safe {safe * 1000:.0f} ms")


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
    assert how is not None, crash.getMessage()
    print(f"\n[bench] {how[1]} while {how[2]} in fast mode -> next text in safe mode: "
          f"{(resumed - crash.created) * 1000:.0f} ms "
          f"(a fresh llama-server, the model loaded, the prompt and the committed text read again); "
          f"median gap between deltas otherwise {statistics.median(gaps) * 1000:.0f} ms")
