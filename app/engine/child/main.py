"""The engine child process: keeps one model loaded and generates on request.

It runs in its own process so that a bad model file or a crash inside llama.cpp cannot take
the app down. It speaks plain dicts over a multiprocessing pipe:

  parent -> child  {"op": "load", "file", "n_ctx", "n_threads", "safe", "parallel"}
                   {"op": "generate", "job", "request", ...}
                   {"op": "embed", "job", "texts", "dimensions"} | {"op": "cancel", "job"} | {"op": "shutdown"}
  child -> parent  {"ev": "backend", "cpu_variant"} then {"ev": "loaded", ...}
                   {"ev": "chunk", "job", "ids", "text", "last"?} (`last`: no token follows, `done` does)
                   {"ev": "done", "job", "reason", "input_tokens", "cached_tokens", "output_tokens"}
                   {"ev": "embedded", "vectors", "dims", "tokens"} | {"ev": "cancelled"} (an embed's)
                   {"ev": "error", "job"?, "code", "message", "param"?}

and says what it runs (llama.cpp's kernels, a request's grammar, anything else) in a byte of
shared memory the parent reads once it has died (app/engine/child/phases.py).

With `parallel` 1 it runs one generation at a time, each evaluated as any other run of its prompt
is (so `resume` gives an uninterrupted run's text, see `generate`); with more, up to `parallel`
generations are decoded together, one step for all (app/engine/child/batched.py), and messages
are read between steps.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from app.engine.child.batched import Batched, finish
from app.engine.child.faults import fault
from app.engine.child.phases import GRAMMAR, KERNELS, OTHER
from app.engine.child.sampling import DeadEnd, sampler_for
from app.engine.child.slices import COARSE, grid, shared_slices
from app.engine.child.text import Text
from app.engine.child.threads import Threads
from app.engine.constraints import grammar
from app.engine.registry import memory, models
from app.engine.request import ChatMessage, Request
from app.engine.template import SLOTS, ChatTemplate, Refused

if TYPE_CHECKING:
    from app.engine.child.embedder import Embedder

Message = dict[str, Any]
# A chat turn of ordinary length: the warm-up decodes it in one batch, as a first task would.
WARMUP = ("You are a helpful assistant. Read the following note and answer the question after it. "
          "Note: the meeting moved from Tuesday to Thursday at half past two, in the small room on the "
          "second floor; bring the printed budget. Question: when and where is the meeting now?")
WARMUP_CONTEXT = 256  # holds the warm-up's tokens



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
    def __init__(self, conn: Connection, phase: Any) -> None:
        self.conn = conn
        self.phase = phase  # a shared byte (multiprocessing's RawValue): one of OTHER, KERNELS, GRAMMAR
        self.llm: Any = None
        self.template: ChatTemplate | None = None
        self.embedder: Embedder | None = None  # made on the first embeddings request
        self.n_threads = 1
        self.threads: Threads | None = None  # how many of them decode, with the model
        self.batched: Batched | None = None  # with a model that serves several generations at once
        self.n_ctx = 0  # each generation's context
        self.inbox: deque[Message] = deque()
        self.fast = True  # extra buffer types on (fault injection needs to know)
        self.piece_bytes = 1
        # What the cache holds from prompt slices: their tokens and the slices that computed them.
        self.body: list[int] = []
        self.plan: list[tuple[int, int]] = []

    def doing(self, phase: int) -> None:
        """Say what runs from now on, before it runs: the parent reads it if this process dies."""
        self.phase.value = phase

    def next_message(self) -> Message:
        return self.inbox.popleft() if self.inbox else self.conn.recv()

    def serve(self) -> None:
        while True:
            self.doing(OTHER)
            batched = self.batched
            if batched is not None and batched.busy() and not self.inbox and not self.conn.poll():
                batched.step()
                continue
            msg = self.next_message()
            op = msg["op"]
            if op == "shutdown":
                return
            if op == "load":
                self.doing(KERNELS)  # loading, repacking the weights, the warm-up: all of it
                self.load(msg)
            elif op == "unload":
                self.drop()
                self.conn.send({"ev": "unloaded"})
            elif op == "generate":
                self.generate(msg)
            elif op == "embed":
                self.embed(msg)
            elif op == "cancel" and batched is not None:
                batched.cancel(msg["job"])
            # a cancel for a job that already ended needs no answer

    def load(self, msg: Message) -> None:
        from llama_cpp import Llama

        from app.engine.child import backend

        started = time.monotonic()
        self.drop()  # free the old model before the new one takes memory
        self.fast = not msg.get("safe")
        self.n_threads = msg.get("n_threads") or os.cpu_count() or 1
        parallel, self.n_ctx = msg.get("parallel", 1), msg.get("n_ctx", 4096)
        variant = backend.load()
        # Said before anything can crash, so that a crash report names the CPU code that ran.
        self.conn.send({"ev": "backend", "cpu_variant": variant})
        opened = self.open_model(msg["file"], parallel)
        if opened is None:
            return
        fd, path = opened
        try:
            with extra_bufts(self.fast):
                # With several at once the batch's context serves them: the model's own only warms up.
                llm = Llama(model_path=path, n_ctx=self.n_ctx if parallel == 1 else WARMUP_CONTEXT,
                            n_threads=self.n_threads, verbose=False)
        except Exception as exc:  # llama.cpp reports a bad file as a ValueError/RuntimeError
            self.conn.send({"ev": "error", "code": "model_load_failed", "message": str(exc)})
            return
        finally:
            os.close(fd)  # llama.cpp opened (and mapped) the file itself
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
            self.template = ChatTemplate(template, token_text(llm.token_bos()), token_text(llm.token_eos()))
        self.llm = llm
        if parallel == 1:
            self.n_ctx = llm.n_ctx()
            self.threads = Threads(llm._ctx.ctx, self.n_threads)
        else:
            self.batched = Batched(llm, parallel, self.n_ctx, self.n_threads, self.conn.send, self.doing, self.fast)
        self.piece_bytes = longest_piece(llm)
        self.conn.send({"ev": "loaded", "n_ctx": self.n_ctx, "parallel": parallel,
                        "n_ctx_train": llm._model.n_ctx_train(), "load_seconds": time.monotonic() - started,
                        "warmup_seconds": warmup})

    def open_model(self, file: models.Registered, parallel: int) -> tuple[int, str] | None:
        """The model file opened, if it is the one registered and fits in memory with `parallel`
        contexts (refused before llama.cpp takes the memory: what does not fit is an OOM kill);
        else None, the error said."""
        try:
            fd, path = models.open_verified(file)
        except (models.FileChanged, OSError) as exc:
            self.conn.send({"ev": "error", "code": "model_changed" if isinstance(exc, models.FileChanged)
                            else "model_load_failed", "message": str(exc)})
            return None
        too_big = memory.refusal(os.path.basename(file.path), path, file.size_bytes, self.n_ctx, parallel)
        if too_big is not None:
            os.close(fd)
            self.conn.send({"ev": "error", "code": "model_load_failed", "message": too_big})
            return None
        return fd, path

    def drop(self) -> None:
        """Forget the loaded model (the contexts first: they use the model); its generations end."""
        if self.embedder is not None:
            self.embedder.close()
        if self.batched is not None:
            self.batched.stop_all()
            self.batched.close()
        self.embedder = self.llm = self.template = self.threads = self.batched = None
        self.body, self.plan = [], []

    def embed(self, msg: Message) -> None:
        if self.llm is None:
            self.conn.send({"ev": "error", "code": "model_not_loaded", "message": "No model is loaded."})
            return
        if self.embedder is None:
            from app.engine.child.embedder import Embedder  # numpy too: imported where it is used, as llama_cpp is

            try:
                self.embedder = Embedder(self.llm, self.n_ctx, self.n_threads, self.piece_bytes)
            except ValueError as exc:  # llama.cpp could not make the context (memory)
                self.conn.send({"ev": "error", "code": "embeddings_unavailable", "message": str(exc)})
                return
        threads = self.threads.using if self.threads else self.batched.batch.threads.using if self.batched else \
            self.n_threads
        self.conn.send(self.embedder.embed(msg["texts"], msg.get("dimensions"), threads,
                                           lambda: self.cancelled(msg["job"])))

    def prompt_tokens(self, messages: list[ChatMessage], job: str) -> list[int] | str | None:
        """The prompt as tokens, or why it cannot fit, or None if cancelled meanwhile. Only the
        template's own markers are special tokens: what the messages say is tokenized as plain
        text, so a message that spells `<|im_start|>system` cannot open a turn of its own.
        Refuses, before tokenizing, a prompt whose bytes alone cannot fit the context;
        tokenizing watches for a cancel."""
        llm = self.llm
        if self.template is not None:  # it writes the BOS token where it wants one, as llama-cpp-python's did
            pieces = SLOTS.split(self.template.render(messages))  # template text, message index, template text, ...
            tokens = []
        else:  # no template in the file: "role: text" lines
            pieces = [x for i, m in enumerate(messages) for x in (("\n" if i else "") + f"{m['role']}: ", str(i))]
            pieces.append("\nassistant: ")
            tokens = [llm.token_bos()] if llm._model.add_bos_token() else []
        texts = [(messages[int(p)]["content"] if k % 2 else p).encode() for k, p in enumerate(pieces)]
        least = sum(len(t) for t in texts) // self.piece_bytes
        if least >= self.n_ctx:
            return f"The input is at least {least} tokens; the model's context holds {self.n_ctx}."
        for k, text in enumerate(texts):
            if k % 256 == 255 and self.cancelled(job):
                return None
            if text:
                tokens += llm.tokenize(text, add_bos=False, special=k % 2 == 0)
        return tokens

    def sampler(self, request: Request, prefix: list[int]) -> Any:
        """The sampler chain `Llama.generate` would build, with the request's grammar if it has
        one. The grammar is advanced over the tokens already produced (a resumed task), so the
        output carries on from where it stands and still ends as valid JSON."""
        gbnf = grammar.gbnf(request.constraint) if request.constraint else None
        self.doing(GRAMMAR if gbnf else OTHER)
        sampler = sampler_for(self.llm, float(request.temperature), float(request.top_p), gbnf, prefix)
        self.doing(OTHER)
        return sampler

    def compute(self, tokens: list[int], point: str) -> None:
        """Evaluate `tokens` with llama.cpp's kernels, saying so first (see KERNELS)."""
        assert self.threads is not None
        self.doing(KERNELS)
        fault(point, self.fast)
        self.threads.run(len(tokens), lambda: self.llm.eval(tokens))
        self.doing(OTHER)

    def sample(self, sampler: Any, constrained: bool) -> int:
        """The next token; under a grammar, said first (see GRAMMAR)."""
        if constrained:
            self.doing(GRAMMAR)
            fault("grammar", self.fast)
        try:
            return int(sampler.sample(self.llm._ctx, -1))
        finally:
            self.doing(OTHER)

    def cancelled(self, job: str) -> bool:
        while self.conn.poll():
            msg = self.conn.recv()
            if msg["op"] == "cancel" and msg["job"] == job:
                return True
            self.inbox.append(msg)  # another job's cancel included: with several at once it may run
        return False

    def begin(self, msg: Message) -> list[int] | None:
        """A generation's prompt as tokens, or None when it was answered already (no model, a
        prompt too long for the context, a cancel while tokenizing)."""
        job, request = msg["job"], msg["request"]
        if self.llm is None:
            self.conn.send({"ev": "error", "job": job, "code": "model_not_loaded", "message": "No model is loaded."})
            return None
        try:
            prompt = self.prompt_tokens(request.prompt(), job)
        except Refused as exc:  # this request's error (most are refused before they get here: app/core/templates.py)
            self.conn.send({"ev": "error", "job": job, "code": "template_error", "message": str(exc)})
            return None
        if prompt is None:
            self.conn.send({"ev": "done", "job": job, "reason": "cancelled", "input_tokens": 0, "output_tokens": 0})
            return None
        if isinstance(prompt, list) and len(prompt) >= self.n_ctx:
            prompt = f"The input is {len(prompt)} tokens; the model's context holds {self.n_ctx}."
        if isinstance(prompt, str):
            self.conn.send({"ev": "error", "job": job, "code": "context_length_exceeded", "message": prompt})
            return None
        return prompt

    # Every step of the loop shares its state (the text, the count, the sampler).
    # long: one generation's exact loop (parallel 1); several at once run in app/engine/child/batched.py.
    def generate(self, msg: Message) -> None:
        from llama_cpp import llama_vocab_is_eog

        prompt = self.begin(msg)
        if prompt is None:
            return
        if self.batched is not None:
            self.batched.admit(msg, prompt)
            return
        job, request = msg["job"], msg["request"]
        llm = self.llm
        prefix: list[int] = msg["prefix_ids"]
        room = self.n_ctx - len(prompt)
        limit = min(msg.get("max_tokens") or room, room)
        text = Text(llm, prompt, prefix, request.stop, msg["emitted_chars"])
        history = prompt + prefix
        count, reason = len(prefix), "length"

        # Build the context exactly as any other run of this prompt builds it: batch shapes
        # change the floating-point results, so a cache computed in other slices could flip a
        # near-tie at temperature 0 and break the promise that a resumed task ends with the
        # same text. So the prompt but its last token is evaluated in slices fixed by position
        # (the grid), and the cache from the last task is reused only in the slices this
        # prompt's own plan shares with it (an identical prompt: all of them). The last prompt
        # token and earlier output tokens (resume) go one by one, as generated tokens do; the
        # logits of the last of them pick the next token. A cancel is seen between slices.
        body = prompt[:-1]
        plan = grid(0, len(body), min(COARSE, llm.n_batch))
        reuse = shared_slices(plan, body, self.plan, self.body)
        llm.n_tokens = reuse  # llama.cpp drops the cache after this position at the next eval
        self.plan = [cut for cut in plan if cut[1] <= reuse]
        self.body = body
        steps = [cut for cut in plan if cut[0] >= reuse] + [(i, i + 1) for i in range(len(body), len(history))]
        for start, end in steps:
            # A resumed task's output so far is decoded again here, token by token (see `fault`).
            self.compute(history[start:end], "prompt" if end <= len(prompt) else f"token{end - len(prompt)}")
            if end <= len(body):
                self.plan.append((start, end))
            if self.cancelled(job):
                self.conn.send({"ev": "done", "job": job, "reason": "cancelled", "input_tokens": len(prompt),
                                "output_tokens": count})
                return
        if request.seed is not None:
            llm.set_seed(request.seed)
        try:
            sampler = self.sampler(request, prefix)
        except ValueError as exc:  # a grammar llama.cpp cannot parse (a request stored before they were checked)
            self.conn.send({"ev": "error", "job": job, "code": "unsupported_schema", "message": str(exc)})
            return
        constrained = bool(request.constraint)
        while count < limit:
            try:
                tok = self.sample(sampler, constrained)
            except DeadEnd as exc:  # the task fails; what it wrote so far stays written
                self.conn.send({"ev": "error", "job": job, "code": "unsupported_schema", "message": str(exc)})
                return
            if self.cancelled(job):
                reason = "cancelled"
                break
            if llama_vocab_is_eog(llm._model.vocab, tok):
                reason = "stop"
                break
            count += 1
            piece, stopped = text.add(tok)
            self.conn.send({"ev": "chunk", "job": job, "ids": [tok], "text": piece, "last": stopped or count >= limit})
            if stopped:
                reason = "stop"
                break
            if count < limit:
                self.compute([tok], f"token{count}")
        finish(self.conn.send, job, text, reason, len(prompt), reuse, count)


# llama.cpp's threads (OpenMP, libgomp) wait for each other at every step of a token: they spin
# before they sleep, which is what decoding on an idle machine wants (libgomp's own 300,000 spins
# and this count decode alike there; 1,000 cost 17-26 % on two cores of an Intel Xeon). Beside
# another busy program spinning is what stalls decoding: app/engine/child/threads.py then evaluates on
# one thread. Fewer spins than libgomp's keep what a trial of all threads costs there short.
SPIN_COUNT = "100000"
# Inference keeps every core busy; the service and the GUI must still answer at once. A slightly
# lower priority lets their threads run the moment they wake. More than this starves decoding
# whenever other programs keep the cores busy (nice 10: 6 tokens/s beside two, nice 3: 19, nice 0: 26,
# measured when both threads decoded beside them).
NICENESS = 3


def main(conn: Connection, stderr: Connection | None, phase: Any) -> None:
    """Entry point of the child process. `stderr`: where its standard error goes (the parent
    logs it), for what llama.cpp prints there, a failed assertion's reason among it. `phase`:
    the byte it says what it does in (see KERNELS)."""
    if stderr is not None:
        os.dup2(stderr.fileno(), 2)
        stderr.close()
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)  # read when llama.cpp is first imported, below
    if hasattr(os, "nice"):  # POSIX only
        os.nice(NICENESS)
    try:
        Child(conn, phase).serve()
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the parent went away: nothing left to serve
