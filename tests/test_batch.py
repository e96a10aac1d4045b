"""Continuous batching (app/engine/child/batch.py) on the real llama.cpp and the default model.

llama.cpp runs in a worker process of its own, never in the test process (a crash in it fails
these tests, not the run), loaded once for the module in safe mode (fast mode's AMX kernels
crash on some CPUs) on one thread (the machine is shared). The scenarios run there and hand back
plain data; the assertions are made here.

Greedy text: batch composition changes llama.cpp's float sums (a step of several rows takes
another matrix-product path than a step of one), and with this small model that flips greedy picks
at near-ties: "What is the capital of France?" goes "L'Étoile, la Cité, ..." alone and "L'Étoile, la
Marseillaise, ..." beside another sequence, from its 8th token on; "Write a haiku about the sea."
beside these three flipped at its first (issue 38, `resume`). So a sequence beside others is held
to its text alone for its first EXACT tokens, and every token it picks to be within NEAR_TIE of the
best one in plain llama-cpp-python's evaluation of the same text (measured: at most 0.2; a sequence
reading another's cells or logits is off by whole logits).
"""

from __future__ import annotations

import json
import multiprocessing
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2+2?",
             "List the days of the week."]
REVIEW = "Classify the sentiment of this product review as positive or negative. Review: "
TOKENS = 16
EXACT = 6
NEAR_TIE = 0.5  # logits
LLM: Any = None  # the worker's model
REFERENCE: Any = None  # and plain llama-cpp-python, every position's logits kept


# --- in the worker process -------------------------------------------------------------------

def load() -> None:
    """The worker's initializer: the default model, as the engine child loads it in safe mode."""
    global LLM, REFERENCE
    from llama_cpp import Llama

    from app import paths
    from app.engine.child import backend
    from app.engine.child.main import extra_bufts

    backend.load()
    with extra_bufts(False):
        LLM = Llama(model_path=str(paths.default_model_file()), n_ctx=256, n_threads=1, verbose=False)
        REFERENCE = Llama(model_path=str(paths.default_model_file()), n_ctx=512, n_threads=1, verbose=False,
                          logits_all=True)


def off_greedy(prompt: list[int], out: list[int]) -> float:
    """How far below the best logit the worst of `out`'s tokens is, in plain llama-cpp-python's
    evaluation of the prompt and `out`."""
    REFERENCE.reset()
    REFERENCE.eval(prompt + out)
    logits = REFERENCE.scores[len(prompt) - 1:len(prompt) - 1 + len(out)]
    return max((float(row.max() - row[tok]) for row, tok in zip(logits, out)), default=0.0)


def chat(question: str) -> list[int]:
    """The default model's chat template (ChatML) around one user turn."""
    text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return LLM.tokenize(text.encode(), add_bos=False, special=True)


def new_batch(parallel: int = 4) -> Any:
    from app.engine.child.batch import Batch

    return Batch(LLM, parallel=parallel, n_ctx=512, n_threads=1)


def greedy(max_tokens: int = TOKENS, **kwargs: Any) -> Any:
    from app.engine.child.batch import Params

    return Params(max_tokens=max_tokens, temperature=0, **kwargs)


def drive(batch: Any, admit: dict[int, list[tuple[str, list[int], Any]]],
          cancel: dict[int, list[str]] | None = None, judge: bool = True) -> dict[str, Any]:
    """Step `batch` until it is idle, admitting and cancelling before the steps named; counts the
    llama_decode calls. -> texts, tokens, finish reasons, the keys that got a token in each step,
    the streams' counts, each decode's size and (`judge`) how far each is from greedy."""
    import llama_cpp

    real, decodes = llama_cpp.llama_decode, []

    def counted(ctx: Any, batch: Any) -> int:
        decodes.append(batch.n_tokens)
        return real(ctx, batch)

    llama_cpp.llama_decode = counted
    texts: defaultdict[str, bytes] = defaultdict(bytes)
    ids: defaultdict[str, list[int]] = defaultdict(list)
    reasons: dict[str, str] = {}
    streams: dict[str, Any] = {}
    steps: list[list[str]] = []
    try:
        while batch.busy() or any(n >= len(steps) for n in admit):
            for key, prompt, params in admit.get(len(steps), []):
                streams[key] = batch.admit(key, prompt, params)
            for key in (cancel or {}).get(len(steps), []):
                batch.cancel(key)
            outs = batch.step()
            steps.append([o.seq for o in outs if o.token is not None])
            for o in outs:
                texts[o.seq] += o.piece
                ids[o.seq] += [] if o.token is None else [o.token]
                if o.finished:
                    reasons[o.seq] = o.finished
    finally:
        llama_cpp.llama_decode = real
    counts = {k: {"prompt": s.prompt_tokens, "reused": s.reused, "evaluated": s.evaluated, "output": s.output_tokens}
              for k, s in streams.items()}
    return {"texts": {k: v.decode(errors="replace") for k, v in texts.items()}, "ids": ids, "reasons": reasons,
            "steps": steps, "counts": counts, "decodes": decodes,
            "off": {k: off_greedy(s.tokens, ids[k]) for k, s in streams.items() if judge}}


def cache_matches(batch: Any) -> bool:
    """Whether every slot's sequence in llama.cpp's cache has exactly the positions the slot says
    it holds, 0 to n-1."""
    from llama_cpp import llama_memory_seq_pos_max, llama_memory_seq_pos_min

    return all((llama_memory_seq_pos_min(batch.mem, s.id), llama_memory_seq_pos_max(batch.mem, s.id))
               == ((0, len(s.cached) - 1) if s.cached else (-1, -1)) for s in batch.slots)


def alone(prompts: dict[str, list[int]], params: Any) -> dict[str, list[int]]:
    """Each prompt's tokens decoded on its own, in a batch of its own."""
    return {key: drive(new_batch(), {0: [(key, prompt, params)]}, judge=False)["ids"][key]
            for key, prompt in prompts.items()}


def interleaving(n: int) -> dict[str, Any]:
    prompts = {f"q{i}": chat(q) for i, q in enumerate(QUESTIONS[:n])}
    run = drive(new_batch(), {0: [(k, p, greedy()) for k, p in prompts.items()]})
    return {**run, "alone": alone(prompts, greedy())}


def cancelling() -> dict[str, Any]:
    from llama_cpp import llama_memory_seq_pos_max

    prompts = {f"q{i}": chat(q) for i, q in enumerate(QUESTIONS[:3])}
    batch = new_batch()
    run = drive(batch, {0: [(k, p, greedy()) for k, p in prompts.items()]}, cancel={6: ["q1"]})
    slot = next(s for s in batch.slots if not s.cached)
    return {**run, "alone": alone(prompts, greedy()), "freed": llama_memory_seq_pos_max(batch.mem, slot.id) == -1,
            "kept": sum(bool(s.cached) for s in batch.slots), "cache_matches": cache_matches(batch)}


def sharing() -> dict[str, Any]:
    from llama_cpp import Llama

    common = Llama.longest_token_prefix
    first, second = chat(REVIEW + "The battery lasts all day."), chat(REVIEW + "The screen cracked in a week.")
    batch = new_batch()
    one = drive(batch, {0: [("first", first, greedy())]})  # then, its slot finished, the second
    after = drive(batch, {0: [("second", second, greedy())]})
    together = drive(new_batch(), {0: [("first", first, greedy()), ("second", second, greedy())]})
    running = drive(new_batch(), {0: [("first", first, greedy())], 3: [("second", second, greedy())]})
    # The next turn of the conversation: its prompt holds the first answer, token by token.
    answer = LLM.tokenize(one["texts"]["first"].encode(), add_bos=False, special=False)
    turn = first + answer + LLM.tokenize(b"<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n",
                                         add_bos=False, special=True)
    batch = new_batch()
    drive(batch, {0: [("first", first, greedy())]})
    follow = drive(batch, {0: [("turn", turn, greedy())]})
    return {"common": common(first, second), "first": len(first), "second": len(second), "one": one,
            "after": after, "together": together, "running": running, "turn": follow,
            "turn_common": common(first + answer, turn), "alone": alone({"second": second}, greedy())}


def parameters(seed: int) -> dict[str, Any]:
    from app.engine.child.batch import Params
    from app.engine.constraints import grammar

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
              "required": ["city", "people"]}
    reason, gbnf = grammar.convert(schema)
    assert reason is None, reason
    prompts = {"json": chat("Give the largest city of Japan and its population as JSON."),
               "text": chat(QUESTIONS[0]), "drawn": chat(QUESTIONS[3])}
    run = drive(new_batch(), {0: [("json", prompts["json"], greedy(60, gbnf=gbnf)),
                                  ("text", prompts["text"], greedy()),
                                  ("drawn", prompts["drawn"], Params(max_tokens=TOKENS, temperature=0.9, seed=seed))]})
    return {**run, "alone": alone({"text": prompts["text"]}, greedy())}


def resuming() -> dict[str, Any]:
    """A sequence given the first tokens of its output (a resumed task), beside a new one."""
    prompts = {"resumed": chat(QUESTIONS[1]), "new": chat(QUESTIONS[2])}
    before = alone(prompts, greedy())
    run = drive(new_batch(), {0: [("resumed", prompts["resumed"], greedy(prefix=tuple(before["resumed"][:5]))),
                                  ("new", prompts["new"], greedy())]})
    return {**run, "alone": {"resumed": before["resumed"][5:], "new": before["new"]}}


def reading() -> dict[str, Any]:
    """A prompt longer than a step takes in, admitted while another sequence generates."""
    prompts = {"short": chat(QUESTIONS[2]), "long": chat(REVIEW + "The battery lasts all day. " * 60)}
    batch, by_itself = new_batch(), new_batch()
    run = drive(batch, {0: [("short", prompts["short"], greedy())], 2: [("long", prompts["long"], greedy())]})
    drive(by_itself, {0: [("long", prompts["long"], greedy())]})  # in steps of its prompt alone
    return {**run, "alone": alone(prompts, greedy()), "length": len(prompts["long"]),
            "cache_matches": cache_matches(batch) and cache_matches(by_itself)}


def limits() -> dict[str, Any]:
    from app.engine.child.batch import Full

    batch = new_batch(parallel=2)
    first = batch.admit("a", chat(QUESTIONS[0]), greedy(3))
    batch.admit("b", chat(QUESTIONS[1]), greedy(3))
    refused = []
    try:
        batch.admit("c", chat(QUESTIONS[2]), greedy(3))
    except Full:
        refused.append("full")
    batch.cancel("b")
    try:
        new_batch().admit("long", list(range(100, 700)), greedy())
    except ValueError:
        refused.append("long")
    return {**drive(batch, {}, judge=False), "refused": refused, "output": first.output_tokens}


# --- in the test process ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker() -> Iterator[ProcessPoolExecutor]:
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=load)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def in_worker(pool: ProcessPoolExecutor, scenario: Any, *args: Any) -> dict[str, Any]:
    return pool.submit(scenario, *args).result(timeout=240)


def like_alone(run: dict[str, Any], keys: list[str]) -> None:
    """Each of `keys` starts as it does alone and never picks a token greedy decoding would not."""
    for key in keys:
        start = run["ids"][key][:EXACT]
        assert start == run["alone"][key][:len(start)], (key, run["texts"])
        assert run["off"][key] <= NEAR_TIE, (key, run["off"], run["texts"])


@pytest.mark.parametrize("n", [2, 4])
def test_sequences_interleave_one_decode_a_step_each_near_its_text_alone(worker: ProcessPoolExecutor, n: int) -> None:
    run = in_worker(worker, interleaving, n)
    like_alone(run, list(run["alone"]))
    assert all(len(t) > 10 for t in run["texts"].values()), run["texts"]
    assert set(run["reasons"].values()) <= {"stop", "length"}
    # One llama_decode a step, and together they took about as many as the longest sequence
    # alone, not the sum.
    assert len(run["decodes"]) == len(run["steps"])
    assert len(run["decodes"]) <= max(c["output"] for c in run["counts"].values()) + 2
    assert any(len(keys) == n for keys in run["steps"]), run["steps"]


def test_cancel_ends_one_sequence_frees_its_cells_and_leaves_the_others_text(worker: ProcessPoolExecutor) -> None:
    run = in_worker(worker, cancelling)
    assert run["reasons"]["q1"] == "cancelled"
    assert 0 < run["counts"]["q1"]["output"] < TOKENS
    like_alone(run, ["q0", "q1", "q2"])
    assert all(run["counts"][k]["output"] > run["counts"]["q1"]["output"] for k in ("q0", "q2"))
    assert run["freed"], "the cancelled sequence's cells are still in the cache"
    assert run["kept"] == 2 and run["cache_matches"], "the finished sequences' cells are kept for reuse"


def test_a_shared_prefix_is_copied_not_evaluated_again(worker: ProcessPoolExecutor) -> None:
    run = in_worker(worker, sharing)
    common, second = run["common"], run["second"]
    assert common > 30, "the prompts share the system turn and the instruction"
    # After the first finished: its slot's cells reused, the rest evaluated.
    counts = run["after"]["counts"]["second"]
    assert (counts["reused"], counts["evaluated"]) == (common, second - common)
    # Admitted together: the second waits for the first to read the common part, then copies it.
    counts = run["together"]["counts"]
    assert counts["first"]["evaluated"] == run["first"]
    assert (counts["second"]["reused"], counts["second"]["evaluated"]) == (common, second - common)
    # Admitted while the first generates: copied from its running sequence.
    assert run["running"]["counts"]["second"]["reused"] == common
    for name in ("after", "together", "running"):
        like_alone({**run[name], "alone": run["alone"]}, ["second"])
    # A conversation's next turn reuses the whole of the turn before, its answer included.
    assert run["turn"]["counts"]["turn"]["reused"] == run["turn_common"] > run["first"]


def test_each_sequence_samples_with_its_own_grammar_seed_and_temperature(worker: ProcessPoolExecutor) -> None:
    seven, again, eight = (in_worker(worker, parameters, seed) for seed in (7, 7, 8))
    answer = json.loads(seven["texts"]["json"])
    assert set(answer) == {"city", "people"} and isinstance(answer["people"], int), answer
    like_alone(seven, ["text"])
    assert seven["texts"]["drawn"] == again["texts"]["drawn"] != eight["texts"]["drawn"]
    assert seven["texts"]["json"] == eight["texts"]["json"] and seven["texts"]["text"] == eight["texts"]["text"]


def test_a_resumed_sequence_carries_on_from_its_output_so_far(worker: ProcessPoolExecutor) -> None:
    run = in_worker(worker, resuming)
    like_alone(run, ["resumed", "new"])
    assert run["counts"]["resumed"]["output"] == 5 + len(run["ids"]["resumed"])  # the prefix counts, as in the child
    assert run["counts"]["resumed"]["output"] == TOKENS or run["reasons"]["resumed"] == "stop"


def test_a_long_prompt_is_read_in_chunks_while_the_others_generate(worker: ProcessPoolExecutor) -> None:
    run = in_worker(worker, reading)
    assert run["length"] > 300 and max(run["decodes"]) <= 256  # a step's tokens at most: the prompt takes several
    like_alone(run, ["short", "long"])
    assert run["cache_matches"]
    counts = run["counts"]["long"]
    assert counts["reused"] > 0 and counts["reused"] + counts["evaluated"] == run["length"]
    # Every step while the long prompt was read gave the short sequence its next token.
    short = [i for i, keys in enumerate(run["steps"]) if "short" in keys]
    assert short == list(range(short[0], short[-1] + 1)), run["steps"]


def test_slots_and_context_bound_what_is_admitted(worker: ProcessPoolExecutor) -> None:
    run = in_worker(worker, limits)
    assert run["refused"] == ["full", "long"]
    assert run["reasons"] == {"a": "length", "b": "cancelled"} and run["output"] == len(run["ids"]["a"]) == 3
