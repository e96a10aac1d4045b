"""Benchmark (not in the default run): continuous batching in the engine child (app/engine/child/batch.py).

Aggregate decode rate, tokens/s of all sequences together, with 1, 2 and 4 sequences of TOKENS
tokens each, distinct prompts sharing a prefix (a system turn and an instruction), against the
same Batch with one sequence and against plain llama-cpp-python generating the same prompts one
after the other; the best of ROUNDS rounds, interleaved. Same model, mode
(tests.bench.test_throughput.fast_works), threads, greedy.
THREADS (LMSP_BENCH_THREADS, default 1): on a machine shared with other busy programs two
threads that wait for each other collapse (app/engine/child/threads.py), on both sides alike.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests.bench.test_throughput import bare_llama

TOKENS = 200
TOPICS = ["lighthouses", "windmills", "canals", "railways"]
ROUNDS = 2
THREADS = int(os.environ.get("LMSP_BENCH_THREADS", "1"))


def prompt(llm: Any, topic: str) -> list[int]:
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\nWrite a detailed essay about the history of {topic}.<|im_end|>\n"
            "<|im_start|>assistant\n")
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def bare_rate(llm: Any, prompts: list[list[int]]) -> float:
    """Plain llama-cpp-python, the prompts one after the other."""
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        out = llm.create_completion(p, max_tokens=TOKENS, temperature=0)
        tokens += out["usage"]["completion_tokens"]
    return tokens / (time.perf_counter() - start)


def batch_rate(llm: Any, prompts: list[list[int]]) -> tuple[float, int]:
    """All the prompts admitted at once to a Batch of 4 slots: tokens/s and llama_decode calls."""
    from app.engine.child.batch import Batch, Params

    batch = Batch(llm, parallel=4, n_ctx=1024, n_threads=THREADS)
    try:
        for i, p in enumerate(prompts):
            batch.admit(i, p, Params(max_tokens=TOKENS, temperature=0))
        start, tokens, steps = time.perf_counter(), 0, 0
        while batch.busy():
            tokens += sum(o.token is not None for o in batch.step())
            steps += 1
        return tokens / (time.perf_counter() - start), steps
    finally:
        batch.close()


@pytest.mark.timeout(1800)
def test_batched_decode_rate_with_1_2_4_sequences_vs_one_and_vs_bare_llama_cpp() -> None:
    llm = bare_llama(threads=THREADS)
    prompts = [prompt(llm, topic) for topic in TOPICS]
    rounds = [(bare_rate(llm, prompts), {n: batch_rate(llm, prompts[:n]) for n in (1, 2, 4)}) for _ in range(ROUNDS)]
    bare = max(r[0] for r in rounds)
    rates = {n: max(r[1][n] for r in rounds) for n in (1, 2, 4)}
    one = rates[1][0]
    print(f"\n[bench] {THREADS} thread(s); plain llama-cpp-python, {len(prompts)} prompts one after the other: "
          f"{bare:.1f} tokens/s")
    for n, (rate, steps) in rates.items():
        print(f"[bench] Batch, {n} sequences of {TOKENS} tokens at once: {rate:.1f} tokens/s in {steps} steps, "
              f"{rate / one:.2f} x 1 sequence, {rate / bare:.2f} x plain")
    assert rates[4][0] >= 1.6 * one  # issue 38: at 4 clients >= 1.6 x the 1-client rate
