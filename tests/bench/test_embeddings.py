"""Benchmark of issue 11: embeddings per second for 100 short sentences, through the service
(HTTP, the engine's embeddings llama-server) against the same request sent straight to a bare
llama-server started as the engine starts its embeddings server (tests/bench/bare.py), same run;
and the memory that server costs beside the model's generation server."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.bench.bare import ALL, Bare
from tests.bench.figures import record
from tests.conftest import Headless, Processes

SENTENCES = [f"Sentence number {i} is about {topic}." for i, topic in
             enumerate(["cats", "the sea", "bread", "trains", "music", "rain", "football", "laptops", "maps",
                        "gardens"] * 10)]
ROUNDS = 3


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def servers(svc: Headless) -> list[int]:
    """The service's llama-server processes, oldest first."""
    assert svc.proc is not None
    out = subprocess.run(["pgrep", "-P", str(svc.proc.pid)], capture_output=True, text=True).stdout
    return sorted(int(pid) for pid in out.split() if Path(f"/proc/{pid}/comm").read_text().strip() == "llama-server")


def per_second(call: Callable[[], None]) -> float:
    call()  # warm
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return len(SENTENCES) / statistics.median(times)


def test_embeddings_per_second_vs_bare_llama_server(headless: Headless, procs: Processes, tmp_path: Path) -> None:
    headless.start()
    headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 2})  # the model loaded

    def served() -> None:
        status, body = headless.post("/v1/embeddings", {"input": SENTENCES, "encoding_format": "base64"})
        assert status == 200 and len(body["data"]) == len(SENTENCES), body

    ours = per_second(served)  # its first call starts the embeddings server
    generation, embeddings = servers(headless)
    peer = Bare(procs, tmp_path / "bare.log", parallel=1, threads=ALL, pooling=0).start().ready(timeout=120)
    req = json.dumps({"input": SENTENCES, "encoding_format": "float"}).encode()

    def straight() -> None:
        request = urllib.request.Request(peer.base_url + "/embeddings", data=req, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert len(json.load(resp)["data"]) == len(SENTENCES)

    theirs = per_second(straight)
    record("100 short sentences embedded", ours, theirs, "/s")
    print(f"[bench] llama-server RSS: the model's generation server {rss_mib(generation):.0f} MiB, its embeddings "
          f"server {rss_mib(embeddings):.0f} MiB")
