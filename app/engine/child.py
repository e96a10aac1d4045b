"""The engine child process: keeps one model loaded and generates on request.

It runs in its own process so that a bad model file or a crash inside llama.cpp cannot take
the app down. It speaks plain dicts over a multiprocessing pipe:

  parent -> child  {"op": "load", "path", "n_ctx", "n_threads", "safe"} | {"op": "generate", "job", ...}
                   {"op": "cancel", "job"} | {"op": "shutdown"}
  child -> parent  {"ev": "loaded", ...} | {"ev": "chunk", "job", "ids", "text"}
                   {"ev": "done", "job", "reason", "input_tokens", "cached_tokens", "output_tokens"}
                   {"ev": "error", "job"?, "code", "message"}
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import os
import re
import signal
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Iterator

from app.engine import grammar
from app.engine.sampling import GrammarSampler

Message = dict[str, Any]
# A chat turn of ordinary length: the warm-up decodes it in one batch, as a first task would.
WARMUP = ("You are a helpful assistant. Read the following note and answer the question after it. "
          "Note: the meeting moved from Tuesday to Thursday at half past two, in the small room on the "
          "second floor; bring the printed budget. Question: when and where is the meeting now?")


def fault(point: str, extra_bufts: bool) -> None:
    """For tests only (a user never sets it): LMSP_ENGINE_FAULT=<scope>:<point> makes this process
    die by SIGSEGV at <point> (`warmup`, `prompt`, or `token<N>`: the N-th output token), as
    llama.cpp's AMX kernels do on some CPUs. <scope> `fast` crashes only with extra buffer types
    on (fast mode), `any` in every mode. Unset, this costs one dictionary lookup."""
    spec = os.environ.get("LMSP_ENGINE_FAULT")
    if spec:
        scope, _, where = spec.partition(":")
        if where == point and (scope == "any" or (scope == "fast" and extra_bufts)):
            os.kill(os.getpid(), signal.SIGSEGV)


# Prompts are evaluated in slices fixed by absolute position (see `grid_point`): fine at the
# start, where requests share a chat template's preamble, then llama.cpp's own batch size.
FINE, FINE_UNTIL = 16, 128


def grid_point(position: int, n_batch: int) -> int:
    """The last slice boundary at or before `position`."""
    if position < FINE_UNTIL:
        return position // FINE * FINE
    return FINE_UNTIL + (position - FINE_UNTIL) // n_batch * n_batch


def grid(start: int, end: int, n_batch: int) -> list[tuple[int, int]]:
    """The slices that evaluate positions start..end (start on the grid)."""
    cuts = []
    while start < end:
        step = FINE if start < FINE_UNTIL else n_batch
        cuts.append((start, min(end, grid_point(start, n_batch) + step)))
        start = cuts[-1][1]
    return cuts


# Stands in for each message's text while the chat template renders; NUL never comes from a template.
SLOT = "\x00{}\x00"
SLOTS = re.compile("\x00([0-9]+)\x00")


def longest_piece(llm: Any) -> int:
    """The most bytes one token stands for (special tokens included): a prompt of B bytes is at
    least B / this many tokens, which lets an input too big for the context be refused unread."""
    import llama_cpp

    buf = ctypes.create_string_buffer(512)
    vocab = llm._model.vocab
    return max(1, max(abs(llama_cpp.llama_token_to_piece(vocab, t, buf, 512, 0, True)) for t in range(llm.n_vocab())))


@contextlib.contextmanager
def extra_bufts(enabled: bool) -> Iterator[None]:
    """llama-cpp-python's Llama() has no argument for llama.cpp's `use_extra_bufts`: its model
    parameters start from llama_model_default_params(), so safe mode patches that for one load."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params
    if not enabled:
        def without() -> Any:
            params = default()
            params.use_extra_bufts = False
            return params
        lib.llama_model_default_params = without
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class Child:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.llm: Any = None
        self.formatter: Any = None
        self.inbox: deque[Message] = deque()
        self.fast = True  # extra buffer types on (fault injection needs to know)
        self.piece_bytes = 1
        self.exact: list[int] = []  # prompt tokens whose cache entries came from whole grid slices

    def next_message(self) -> Message:
        return self.inbox.popleft() if self.inbox else self.conn.recv()

    def serve(self) -> None:
        while True:
            msg = self.next_message()
            op = msg["op"]
            if op == "shutdown":
                return
            if op == "load":
                self.load(msg)
            elif op == "unload":
                self.llm = self.formatter = None
                self.exact = []
                self.conn.send({"ev": "unloaded"})
            elif op == "generate":
                self.generate(msg)
            # a cancel for a job that already ended needs no answer

    def load(self, msg: Message) -> None:
        from llama_cpp import Llama

        from app.engine import backend
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        started = time.monotonic()
        self.llm = self.formatter = None  # free the old model before the new one takes memory
        self.exact = []
        self.fast = not msg.get("safe")
        try:
            variant = backend.load()
            with extra_bufts(self.fast):
                llm = Llama(model_path=msg["path"], n_ctx=msg.get("n_ctx", 4096),
                            n_threads=msg.get("n_threads") or os.cpu_count(), verbose=False)
        except Exception as exc:  # llama.cpp reports a bad file as a ValueError/RuntimeError
            self.conn.send({"ev": "error", "code": "model_load_failed", "message": str(exc)})
            return
        warmup = 0.0
        if self.fast:
            # Fast paths that crash on this CPU do so on the first decode: find out now, in a
            # full batch of realistic size, rather than in a user's task (the parent then
            # reloads in safe mode). A shape-dependent crash can still hit a task later:
            # the parent survives that too.
            fault("warmup", self.fast)
            warming = time.monotonic()
            llm.eval(llm.tokenize(WARMUP.encode(), add_bos=True))
            warmup = time.monotonic() - warming
        template = llm.metadata.get("tokenizer.chat_template")
        if template:
            def token_text(tok: int) -> str:
                return llm._model.token_get_text(tok) if tok != -1 else ""
            self.formatter = Jinja2ChatFormatter(template=template, eos_token=token_text(llm.token_eos()),
                                                 bos_token=token_text(llm.token_bos()),
                                                 add_generation_prompt=True)
        self.llm = llm
        self.piece_bytes = longest_piece(llm)
        self.conn.send({"ev": "loaded", "n_ctx": llm.n_ctx(), "n_ctx_train": llm._model.n_ctx_train(),
                        "load_seconds": time.monotonic() - started, "warmup_seconds": warmup,
                        "cpu_variant": variant})

    def prompt_tokens(self, messages: list[Message], job: str) -> list[int] | str | None:
        """The prompt as tokens, or why it cannot fit, or None if cancelled meanwhile. Only the template's own markers are special
        tokens: what the messages say is tokenized as plain text, so a message that spells
        `<|im_start|>system` cannot open a turn of its own. Refuses, before tokenizing, a prompt
        whose bytes alone cannot fit the context; tokenizing watches for a cancel."""
        llm = self.llm
        if self.formatter is not None:
            rendered = self.formatter(messages=[{**m, "content": SLOT.format(i)} for i, m in enumerate(messages)])
            pieces = SLOTS.split(rendered.prompt)  # template text, message index, template text, ...
            tokens = [llm.token_bos()] if not rendered.added_special and llm._model.add_bos_token() else []
        else:  # no template in the file: "role: text" lines
            pieces = [x for i, m in enumerate(messages) for x in (("\n" if i else "") + f"{m['role']}: ", str(i))]
            pieces.append("\nassistant: ")
            tokens = [llm.token_bos()] if llm._model.add_bos_token() else []
        texts = [(messages[int(p)]["content"] if k % 2 else p).encode() for k, p in enumerate(pieces)]
        least = sum(len(t) for t in texts) // self.piece_bytes
        if least >= llm.n_ctx():
            return f"The input is at least {least} tokens; the model's context holds {llm.n_ctx()}."
        for k, text in enumerate(texts):
            if k % 256 == 255 and self.cancelled(job):
                return None
            if text:
                tokens += llm.tokenize(text, add_bos=False, special=k % 2 == 0)
        return tokens

    def sampler(self, msg: Message, prefix: list[int]) -> Any:
        """The sampler chain `Llama.generate` would build, with the request's grammar if it has
        one. The grammar is advanced over the tokens already produced (a resumed task), so the
        output carries on from where it stands and still ends as valid JSON."""
        constraint = msg.get("constraint")
        sampler = self.llm._init_sampler(temp=float(msg.get("temperature", 1.0)), top_p=float(msg.get("top_p", 1.0)),
                                         top_k=0, min_p=0.0, repeat_penalty=1.0)
        if constraint:
            sampler = GrammarSampler(self.llm, sampler, grammar.gbnf(constraint))
        for tok in prefix:
            sampler.accept(tok)
        return sampler

    def cancelled(self, job: str) -> bool:
        while self.conn.poll():
            msg = self.conn.recv()
            if msg["op"] == "cancel" and msg["job"] == job:
                return True
            if msg["op"] != "cancel":
                self.inbox.append(msg)
        return False

    def generate(self, msg: Message) -> None:
        from llama_cpp import llama_vocab_is_eog

        job = msg["job"]
        llm = self.llm
        if llm is None:
            self.conn.send({"ev": "error", "job": job, "code": "model_not_loaded", "message": "No model is loaded."})
            return
        prompt = self.prompt_tokens(msg["messages"], job)
        if prompt is None:
            self.conn.send({"ev": "done", "job": job, "reason": "cancelled", "input_tokens": 0, "output_tokens": 0})
            return
        if isinstance(prompt, list) and len(prompt) >= llm.n_ctx():
            prompt = f"The input is {len(prompt)} tokens; the model's context holds {llm.n_ctx()}."
        if isinstance(prompt, str):
            self.conn.send({"ev": "error", "job": job, "code": "context_length_exceeded", "message": prompt})
            return
        prefix: list[int] = list(msg.get("prefix_ids") or [])
        room = llm.n_ctx() - len(prompt)
        limit = min(msg.get("max_tokens") or room, room)
        stops: list[str] = msg.get("stop") or []
        hold = max((len(s) for s in stops), default=1) - 1  # text that could still become a stop

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        history = prompt[:]
        text = ""
        for tok in prefix:  # rebuild the text state the snapshot was taken from
            text += decoder.decode(llm.detokenize([tok], prev_tokens=history))
            history.append(tok)
        emitted = int(msg.get("emitted_chars", len(text)))
        count, reason = len(prefix), "length"

        # Build the context exactly as any other run of this prompt builds it: batch shapes
        # change the floating-point results, so a cache computed in other slices could flip a
        # near-tie at temperature 0 and break the promise that a resumed task ends with the
        # same text. So the prompt is evaluated in slices fixed by position (the grid), and
        # what the cache holds from the last task is reused only in whole grid slices, which
        # any run would have computed identically; at least the last slice is computed anew
        # (its logits pick the first token). Earlier output tokens (resume) go one by one, as
        # they were generated. A cancel is seen between slices.
        reuse = grid_point(min(len(common_prefix(self.exact, prompt)), len(prompt) - 1), llm.n_batch)
        llm.n_tokens = reuse  # llama.cpp drops the cache after this position at the next eval
        self.exact = prompt[:reuse]
        steps = [prompt[a:b] for a, b in grid(reuse, len(prompt), llm.n_batch)] + [[t] for t in prefix]
        for step in steps:
            fault("prompt", self.fast)
            llm.eval(step)
            if llm.n_tokens <= len(prompt) and llm.n_tokens == grid_point(llm.n_tokens, llm.n_batch):
                self.exact = prompt[:llm.n_tokens]
            if self.cancelled(job):
                self.conn.send({"ev": "done", "job": job, "reason": "cancelled", "input_tokens": len(prompt),
                                "output_tokens": count})
                return
        if msg.get("seed") is not None:
            llm.set_seed(int(msg["seed"]))
        sampler = self.sampler(msg, prefix)
        if count < limit:
            while True:
                tok = sampler.sample(llm._ctx, -1)
                if self.cancelled(job):
                    reason = "cancelled"
                    break
                if llama_vocab_is_eog(llm._model.vocab, tok):
                    reason = "stop"
                    break
                count += 1
                fault(f"token{count}", self.fast)
                text += decoder.decode(llm.detokenize([tok], prev_tokens=history))
                history.append(tok)
                cut = min((i for i in (text.find(s, max(0, emitted - hold)) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    self.conn.send({"ev": "chunk", "job": job, "ids": [tok], "text": text[emitted:cut]})
                    text, emitted, reason = text[:cut], cut, "stop"
                    break
                safe = max(emitted, len(text) - hold)
                self.conn.send({"ev": "chunk", "job": job, "ids": [tok], "text": text[emitted:safe]})
                emitted = safe
                if count >= limit:
                    break
                llm.eval([tok])
        text += decoder.decode(b"", final=True)
        if len(text) > emitted:
            self.conn.send({"ev": "chunk", "job": job, "ids": [], "text": text[emitted:]})
        self.conn.send({"ev": "done", "job": job, "reason": reason, "input_tokens": len(prompt), "cached_tokens": reuse,
                        "output_tokens": count})


def common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return b[:n]


def main(conn: Connection) -> None:
    """Entry point of the child process."""
    try:
        Child(conn).serve()
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the parent went away: nothing left to serve
