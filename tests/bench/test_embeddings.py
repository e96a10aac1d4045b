"""Benchmark of issue 11: embeddings per second for 100 short sentences, through the service
(HTTP, engine child) against bare llama-cpp-python's `Llama.embed` on the same file, same run;
and the memory the engine child's embeddings context costs."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from app import paths
from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.conftest import Headless

SENTENCES = [f"Sentence number {i} is about {topic}." for i, topic in
             enumerate(["cats", "the sea", "bread", "trains", "music", "rain", "football", "laptops", "maps",
                        "gardens"] * 10)]
ROUNDS = 3


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def bare_rate(fast: bool) -> float:
    """`Llama.embed` with what the engine's embeddings context has: mean pooling, the whole context
    as one batch, the same threads, and the engine mode the service runs the model in."""
    import llama_cpp
    from llama_cpp import Llama

    from app.engine.child import backend
    from app.engine.child.main import extra_bufts

    backend.load()
    with extra_bufts(fast):
        llm = Llama(model_path=str(paths.default_model_file()), embedding=True,
                    pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, n_ctx=4096, n_batch=4096, n_ubatch=4096,
                    n_threads=os.cpu_count(), verbose=False)
    llm.embed(SENTENCES[:4], normalize=True)  # warm
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        llm.embed(SENTENCES, normalize=True)
        times.append(time.perf_counter() - start)
    return len(SENTENCES) / statistics.median(times)


def test_embeddings_per_second_vs_bare_llama_cpp(headless: Headless) -> None:
    headless.start()
    headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 2})  # the model loaded
    engine = headless.engine_pids()[0]
    before = rss_mib(engine)
    status, body = headless.post("/v1/embeddings", {"input": SENTENCES[:4]})  # makes the embeddings context
    assert status == 200, body
    after = rss_mib(engine)
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        status, body = headless.post("/v1/embeddings", {"input": SENTENCES, "encoding_format": "base64"})
        times.append(time.perf_counter() - start)
        assert status == 200 and len(body["data"]) == len(SENTENCES)
    served = len(SENTENCES) / statistics.median(times)
    mode = next(m for m in headless.get("/v1/models")[1]["data"] if m["id"] == DEFAULT_MODEL_ID)["engine"]["mode"]
    bare = bare_rate(mode == "fast")
    print(f"\nengine mode: {mode}; engine child RSS: {before:.0f} MiB with the model loaded, "
          f"{after:.0f} MiB with the embeddings context too (+{after - before:.0f} MiB)")
    print(f"100 short sentences: service {served:.0f} embeddings/s, bare llama-cpp-python {bare:.0f}/s "
          f"(service / bare = {served / bare:.2f}x)")
    assert served > 0.3 * bare
