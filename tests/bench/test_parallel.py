"""Benchmarks of issue 38 (not in the default run): several clients at once on one loaded model.

The peer is llama.cpp's own `llama-server` with `--parallel N` (continuous batching): the app's
own build (`make`), so that both pick the same CPU kernels at run time. Same model (the default SmolLM2),
same context per slot (the app's CONTEXT: llama-server gets N x CONTEXT for N slots), same threads
(all cores: the app's one engine has them), same prompts, greedy. Where the app's engine runs in
safe mode on this CPU (fast mode crashes: AMX on Sapphire Rapids; tests.bench.test_throughput.
fast_works), llama-server runs with `--no-repack`, llama.cpp's same switch (`use_extra_bufts` off),
so both run the same kernels. The service's side: the setting `parallel` = N.

- aggregate decode, tokens/s of 1, 2, 4 and 8 streaming clients at once (TOKENS each, distinct
  prompts sharing a prefix): all their tokens over the wall time from the first request to the last
  done; with the service's fsyncs (store commits) and CPU milliseconds per generated token;
- time to first text of a 2-token request arriving while 3 long generations run, p50/p99;
- one stream alone with `parallel` 1 and 4: first text and decode.
Every ratio is against a figure from the same run.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from app.engine.registry.models import CONTEXT
from tests.bench.test_streaming import Stream, chat_body, direct_stream, metric, ms, pct, service_stream, sse
from tests.bench.test_throughput import fast_works
from tests.conftest import LLAMA_SERVER, Headless, Upstream, cpu_seconds, wait_until

pytestmark = pytest.mark.timeout(3600)

TOKENS = 200
CLIENTS = (1, 2, 4, 8)
ROUNDS = 2  # interleaved, the best of each side
TOPICS = ["lighthouses", "windmills", "canals", "railways", "bridges", "clocks", "printing", "sailing ships"]
LONG = 400  # tokens of each of the 3 long generations the short requests arrive behind
TRIALS = 20
# Seconds of short-request trials a side gets at most: served one at a time, each waits for the
# long generations queued before it, and 20 of those would take many minutes.
BUDGET = 120.0
SINGLE_ROUNDS = 3  # one stream alone, each `parallel` twice in turn


def essay(topic: str) -> str:
    """A prompt that generates long; those of all topics share their start (and the chat template's)."""
    return f"Write a detailed essay about the history of {topic}."


@dataclass
class Side:
    """One server under test: a whole stream timed, or the events of one."""
    name: str
    stream: Callable[[str, int], Stream]  # (prompt, max tokens)
    events: Callable[[str, int], Iterator[tuple[float, dict[str, Any]]]]


def lmsp(svc: Headless) -> Side:
    def events(prompt: str, tokens: int) -> Iterator[tuple[float, dict[str, Any]]]:
        body = {"input": prompt, "max_output_tokens": tokens, "temperature": 0, "stream": True}
        return sse(svc.url + "/v1/responses", body, svc.token)
    return Side("LMSP", lambda prompt, tokens: service_stream(svc, tokens, input=prompt), events)


def llama_server(up: Upstream) -> Side:
    return Side("llama-server", lambda prompt, tokens: direct_stream(up, tokens, prompt),
                lambda prompt, tokens: sse(up.base_url + "/chat/completions", chat_body(up, tokens, prompt)))


def has_text(event: dict[str, Any]) -> bool:
    """Whether an event of either stream (the Responses API's, a chat completion's) carries text."""
    return event.get("type") == "response.output_text.delta" or any(
        (choice.get("delta") or {}).get("content") for choice in event.get("choices") or ())


def serve(svc: Headless, parallel: int) -> Side:
    """The service with `parallel` slots, restarted (an engine keeps what it started with), its model loaded."""
    if svc.proc is None:
        svc.start()
    status, body = svc.request("PATCH", "/v1/settings", {"parallel": parallel, "max_queued_tasks_per_client": 1000})
    assert status == 200, body
    assert svc.terminate() == 0
    svc.start()
    svc.post("/v1/responses", {"input": "hi", "max_output_tokens": 4})
    return lmsp(svc)


def peer(upstreams: Any, parallel: int) -> Upstream:
    """llama-server with `parallel` slots of the app's context each, warm."""
    up: Upstream = upstreams(1, threads=os.cpu_count() or 1, parallel=parallel, fast=fast_works(), options=(
        "--ctx-size", str(parallel * CONTEXT), "--cont-batching"))[0]
    direct_stream(up, 8)
    return up


def aggregate(side: Side, clients: int) -> tuple[float, int]:
    """`clients` streams of TOKENS at once, one topic each: tokens/s of all of them (from the first
    request to the last done), and how many tokens."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        streams = list(pool.map(lambda topic: side.stream(essay(topic), TOKENS), TOPICS[:clients]))
    tokens = sum(s.tokens for s in streams)
    return tokens / (time.perf_counter() - start), tokens


@dataclass
class Costs:
    """The service's own work per generated token over one measurement."""
    rate: float  # tokens/s
    fsyncs: float  # store commits per token
    cpu: float  # the service process's CPU seconds per token (its engine child's not counted)


def measured(svc: Headless, clients: int) -> Costs:
    assert svc.proc is not None
    commits, used = metric(svc, "lmsp_store_commits_total"), cpu_seconds(svc.proc.pid)
    rate, tokens = aggregate(lmsp(svc), clients)
    cpu = cpu_seconds(svc.proc.pid) - used
    after = metric(svc, "lmsp_store_commits_total")
    fsyncs = (after - commits) / tokens if after is not None and commits is not None else float("nan")
    return Costs(rate, fsyncs, cpu / tokens)


def test_aggregate_decode_with_1_2_4_8_clients_vs_llama_server(headless: Headless, upstreams: Any) -> None:
    ours: dict[int, Costs] = {}
    theirs: dict[int, float] = {}
    for clients in CLIENTS:
        serve(headless, clients)
        up = peer(upstreams, clients)
        rounds = [(measured(headless, clients), aggregate(llama_server(up), clients)[0]) for _ in range(ROUNDS)]
        ours[clients] = max((r[0] for r in rounds), key=lambda c: c.rate)
        theirs[clients] = max(r[1] for r in rounds)
        up.kill()
    one = ours[1].rate
    print(f"\n[bench] aggregate decode, N streaming clients x {TOKENS} tokens at once, distinct prompts sharing a "
          f"prefix; LMSP `parallel` = N, llama-server --parallel N ({LLAMA_SERVER.resolve().parent.name}, "
          f"{'fast' if fast_works() else 'safe: --no-repack'}), best of {ROUNDS}:"
          f"\n  {'N':>2} | {'LMSP tok/s':>10} | {'llama-server':>12} | {'ratio':>5} | {'x LMSP@1':>8} | "
          f"{'fsyncs/token':>12} | {'CPU ms/token':>12}")
    for n in CLIENTS:
        c = ours[n]
        print(f"  {n:>2} | {c.rate:>10.1f} | {theirs[n]:>12.1f} | {c.rate / theirs[n]:>5.2f} | {c.rate / one:>8.2f} | "
              f"{c.fsyncs:>12.3f} | {c.cpu * 1000:>12.3f}")
    behind = [n for n in CLIENTS if ours[n].rate < theirs[n]]
    assert not behind, f"LMSP's aggregate decode below llama-server's with {behind} clients"
    assert ours[4].rate >= 1.6 * one, f"LMSP with 4 clients: {ours[4].rate / one:.2f} x its 1-client rate (< 1.6)"


def first_texts(side: Side) -> list[float]:
    """Time to first text of a 2-token request (a distinct one each trial) while 3 long generations
    run (each started again when it ends): TRIALS trials, or as many as BUDGET seconds hold."""
    stop = threading.Event()
    started = [threading.Event() for _ in range(3)]

    def load(i: int) -> None:
        while not stop.is_set():
            for _, event in side.events(essay(TOPICS[i]), LONG):
                if has_text(event):
                    started[i].set()

    loaders = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for loader in loaders:
        loader.start()
    took: list[float] = []
    try:
        wait_until(lambda: all(s.is_set() for s in started), timeout=120, what="3 long generations to start")
        deadline = time.monotonic() + BUDGET
        for trial in range(TRIALS):
            if time.monotonic() > deadline:
                break
            time.sleep(0.3)  # so that the trials land at different points of the long ones
            start = time.perf_counter()
            texts = [at for at, event in side.events(f"Classify: item {trial}", 2) if has_text(event)]
            took.append(texts[0] - start)
    finally:
        stop.set()
        for loader in loaders:
            loader.join()
    return took


def test_first_text_of_a_short_request_behind_3_long_ones_vs_llama_server(headless: Headless, upstreams: Any
                                                                           ) -> None:
    ours = first_texts(serve(headless, 4))
    theirs = first_texts(llama_server(peer(upstreams, 4)))
    print(f"\n[bench] first text of a 2-token request while 3 generations of {LONG} tokens run, 4 slots each side:"
          f"\n  {'':>12} | {'trials':>6} | {'p50':>9} | {'p99':>9}")
    for name, took in (("LMSP", ours), ("llama-server", theirs)):
        print(f"  {name:>12} | {len(took):>6} | {ms(pct(took, 0.5)):>9} | {ms(pct(took, 0.99)):>9}")
    p99, peer_p99 = pct(ours, 0.99), pct(theirs, 0.99)
    print(f"  LMSP p99 / llama-server's: {p99 / peer_p99:.2f}")
    assert p99 <= 1.2 * peer_p99 and p99 <= 0.25, f"LMSP p99 {ms(p99)}, llama-server's {ms(peer_p99)}"


def test_single_stream_with_parallel_1_vs_4(headless: Headless) -> None:
    """One stream alone (the benches' usual prompt) must not get slower for the slots it does not use."""
    runs: dict[int, list[Stream]] = {1: [], 4: []}
    for parallel in (1, 4, 1, 4):  # in turn, so that both see the same machine
        side = serve(headless, parallel)
        runs[parallel] += [side.stream(essay("lighthouses"), TOKENS) for _ in range(SINGLE_ROUNDS)]
    first = {p: statistics.median(r.first for r in runs[p]) for p in runs}
    decode = {p: statistics.median(r.decode for r in runs[p]) for p in runs}
    print(f"\n[bench] one {TOKENS}-token stream alone, median of {2 * SINGLE_ROUNDS}:"
          f"\n  {'parallel':>8} | {'first text':>10} | {'decode tok/s':>12}")
    for p in runs:
        print(f"  {p:>8} | {ms(first[p]):>10} | {decode[p]:>12.1f}")
    # The machine's speed drifts by several percent from one round to the next (test_streaming.ROUNDS).
    assert decode[4] >= 0.95 * decode[1], f"decode with parallel 4: {decode[4] / decode[1]:.3f} x parallel 1"
    assert first[4] <= 1.1 * first[1] + 0.005, f"first text with parallel 4 {ms(first[4])}, 1: {ms(first[1])}"
