"""Continuous batching: several sequences decoded together in one llama.cpp context (engine child only).

A `Batch` holds one llama.cpp context shared by up to `parallel` sequences, each under its own
llama.cpp sequence id (a slot). Every `step` is ONE `llama_decode`: the next token of every
sequence that is generating, plus a chunk of the prompts of sequences admitted since, so a
sequence joins and leaves between steps and no one waits for a batch to drain. Each sequence
samples from its own row of logits with its own sampler chain (temperature, top-p, seed, grammar).

The KV cache is llama.cpp's unified one (`kv_unified`): one buffer of `parallel` x `n_ctx`
cells that every sequence's cells live in, a cell tagged with each sequence it belongs to. That
is what makes prompt sharing cheap: `llama_memory_seq_cp` of a prefix only tags the cells it
covers with one more sequence id, no data moves and no memory is spent, for any prefix length.
With one buffer per sequence (the default) a copy between sequences moves whole buffers and
llama.cpp aborts the process on a partial one ("seq_cp() is only supported for full KV
buffers"). The price: a token's attention spans the whole buffer (masked), which llama.cpp's own
note says is slower when sequences share little; at this app's context sizes the weights, read
once per step for all sequences, cost far more (tests/bench/test_batch.py).

Each slot's sequence holds at most `n_ctx` positions (the prompt and the output are bounded by it
at admission), so `parallel` slots never need more than the buffer's cells, shared cells counted
once. A finished sequence's cells stay in its slot: the next sequence whose prompt shares a prefix
with any slot (running or finished) starts from a copy of it, the longest common prefix token by
token, and evaluates only the rest. Which free slot a sequence takes: the one holding that prefix,
else an empty one, else the one that served least recently.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from app.engine.child.phases import GRAMMAR, KERNELS, OTHER
from app.engine.child.sampling import DeadEnd, sampler_for
from app.engine.child.threads import Threads


class Full(Exception):
    """Every slot has a sequence: admit again once one has finished."""


@dataclass(frozen=True)
class Params:
    """How one sequence samples and when it ends."""
    max_tokens: int | None = None   # output tokens, the prefix's included; None: until its context is full
    temperature: float = 1.0        # 0: greedy
    top_p: float = 1.0
    seed: int | None = None         # None: a random draw
    gbnf: str | None = None         # the output's grammar (app.engine.constraints.grammar.gbnf)
    prefix: tuple[int, ...] = ()    # output produced before (a resumed task): evaluated and accepted, not emitted


class Out(NamedTuple):
    """What one step produced for one sequence."""
    seq: Hashable
    token: int | None       # None when it ended without a token (end of generation, cancel, dead end)
    piece: bytes            # the token's bytes (a UTF-8 character may span tokens)
    finished: str | None    # "stop" (end of generation), "length", "cancelled", "dead_end" (the grammar allows nothing)


@dataclass(eq=False)
class Slot:
    id: int                                           # llama.cpp's sequence id
    cached: list[int] = field(default_factory=list)   # the tokens the cache holds for it, at positions 0..n-1
    stream: Stream | None = None
    used: int = 0                                     # the step it last served in


@dataclass(eq=False)
class Stream:
    """One admitted sequence, as `admit` hands it back: the counts are the caller's to read."""
    key: Hashable
    tokens: list[int]            # the prompt and the prefix: evaluated before the first sample
    limit: int                   # output tokens at most, the prefix's included
    sampler: Any
    constrained: bool
    prompt_tokens: int
    output_tokens: int           # the prefix's included, as the child counts them
    reused: int = 0              # tokens of `tokens` found in the cache: not evaluated
    evaluated: int = 0           # tokens of `tokens` evaluated for it
    slot: Slot | None = None     # None while waiting to be placed
    next: int | None = None      # the token sampled last, evaluated in the next step
    cancelled: bool = False
    keep: bool = False           # cancelled but its cells kept for reuse

    @property
    def fed(self) -> int:
        """How many of `tokens` the cache holds."""
        return min(len(self.slot.cached), len(self.tokens)) if self.slot else 0


class Batch:
    def __init__(self, llm: Any, parallel: int, n_ctx: int, n_threads: int, n_batch: int = 256,
                 doing: Callable[[int], None] = lambda phase: None,
                 before: Callable[[set[str]], None] = lambda points: None) -> None:
        """`llm`: the child's Llama (its model, tokenizer and sampler chain; its own context is
        not used). `n_ctx`: each sequence's context. `n_batch`: tokens one step evaluates at most
        (a prompt is read in chunks of what the generating sequences leave of it). `doing`: the
        child's `doing`, told what runs (llama.cpp's kernels, a grammar) before it runs. `before`:
        told, before each step's evaluation, what it evaluates (`prompt`, `token<N>`: a sequence's
        N-th output token), and before a grammar picks a token (`grammar`): the child's fault injection."""
        import llama_cpp
        from llama_cpp._internals import LlamaBatch, LlamaContext

        if not 1 <= parallel <= n_batch:
            raise ValueError(f"parallel must be 1..{n_batch}")
        self.lib = llama_cpp
        self.llm = llm
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.doing = doing
        self.before = before
        params = type(llm.context_params).from_buffer_copy(llm.context_params)  # as the child's own context
        params.n_ctx = parallel * n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = parallel
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = n_threads
        self.ctx = LlamaContext(model=llm._model, params=params, verbose=False)
        self.mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        self.threads = Threads(self.ctx.ctx, n_threads)  # one thread while another program keeps the cores busy
        self.batch = LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)
        # A prefix can be taken from another sequence only where the cache holds every position's
        # keys and values: a recurrent state holds the whole sequence at once, and a sliding
        # window's cache has dropped what lies behind the window.
        self.shares = not (llm._is_recurrent or llm._is_hybrid or llama_cpp.llama_model_n_swa(llm._model.model))
        self.slots = [Slot(i) for i in range(parallel)]
        self.streams: dict[Hashable, Stream] = {}   # admitted and not yet finished, in admission order
        self.ended: list[Out] = []                  # finished between steps, reported by the next
        self.steps = 0

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()

    def admit(self, key: Hashable, prompt: list[int], params: Params) -> Stream:
        """Take a sequence in: it is placed and starts reading its prompt in the next step. Raises
        Full when every slot has one, ValueError for a prompt its context cannot hold or a grammar
        llama.cpp cannot parse."""
        if key in self.streams:
            raise ValueError(f"{key!r} is already admitted")
        if len(self.streams) == len(self.slots):
            raise Full(f"all {len(self.slots)} slots are busy")
        tokens = list(prompt) + list(params.prefix)
        if not prompt or len(tokens) >= self.n_ctx:
            raise ValueError(f"The input is {len(tokens)} tokens; the context holds {self.n_ctx}.")
        room = self.n_ctx - len(prompt)
        # Each sampler draws with its own seed: `_init_sampler` reads it from the Llama.
        self.llm.set_seed(self.lib.LLAMA_DEFAULT_SEED if params.seed is None else params.seed)
        self.doing(GRAMMAR if params.gbnf else OTHER)
        try:
            sampler = sampler_for(self.llm, float(params.temperature), float(params.top_p), params.gbnf,
                                  list(params.prefix))
        finally:
            self.doing(OTHER)
        stream = Stream(key, tokens, min(params.max_tokens or room, room), sampler, bool(params.gbnf), len(prompt),
                        len(params.prefix))
        self.streams[key] = stream
        if stream.output_tokens >= stream.limit:  # a resumed task that had reached its limit
            self.ended.append(self._end(stream, None, "length"))
        return stream

    def cancel(self, key: Hashable, keep: bool = False) -> None:
        """End a sequence at the next step, which reports it "cancelled" and frees its cells
        (`keep`: leaves them for a later sequence to reuse, as when the caller found a stop
        sequence). The other sequences carry on undisturbed. Unknown or ended keys are ignored."""
        stream = self.streams.get(key)
        if stream is not None:
            stream.cancelled, stream.keep = True, keep

    def busy(self) -> bool:
        """Whether a step has anything to do."""
        return bool(self.streams or self.ended)

    def step(self) -> list[Out]:
        """One llama_decode for every sequence with something to evaluate; what each produced."""
        self.steps += 1
        out, self.ended = self.ended, []
        for stream in [s for s in self.streams.values() if s.cancelled]:
            out.append(self._end(stream, None, "cancelled", keep=stream.keep))
        for stream in [s for s in self.streams.values() if s.slot is None]:
            self._place(stream)
        rows, points = self._fill()
        size = self.batch.batch.n_tokens
        if not size:
            return out
        self.doing(KERNELS)
        self.before(points)
        status = self.threads.run(size, lambda: self.lib.llama_decode(self.ctx.ctx, self.batch.batch))
        self.doing(OTHER)
        if status != 0:
            # Cannot happen while each slot stays within its context (see the module's note).
            raise RuntimeError(f"llama_decode failed ({status})")
        out += [self._sample(stream, row) for stream, row in rows]
        return out

    def _place(self, stream: Stream) -> None:
        """Give a waiting sequence a slot, holding as much of its tokens as the cache has: a
        free slot's own, or a copy of any slot's. Leaves it waiting when a sequence still reading
        its prompt will soon hold more of it (several similar prompts admitted at once are
        computed once)."""
        tokens, lib, mem = stream.tokens, self.lib, self.mem

        def reach(held: list[int]) -> int:  # the last token is evaluated in any case: its logits pick the first
            return min(self.llm.longest_token_prefix(held, tokens), len(tokens) - 1) if self.shares else 0

        source = max(self.slots, key=lambda s: reach(s.cached))
        shared = reach(source.cached)
        if any(reach(s.tokens) > shared for s in self.streams.values() if s.slot and s.fed < len(s.tokens)):
            return
        if shared and source.stream is None:
            slot = source  # a free slot holding the prefix: the rest goes (never refused where self.shares)
            lib.llama_memory_seq_rm(mem, slot.id, shared, -1)
        else:
            slot = min((s for s in self.slots if s.stream is None), key=lambda s: (bool(s.cached), s.used))
            lib.llama_memory_seq_rm(mem, slot.id, -1, -1)
            if shared:
                lib.llama_memory_seq_cp(mem, source.id, slot.id, 0, shared)
        slot.cached = tokens[:shared]
        slot.stream, stream.slot, stream.reused = stream, slot, shared

    def _fill(self) -> tuple[list[tuple[Stream, int]], set[str]]:
        """Put this step's tokens in the batch: each generating sequence's last token first,
        then prompt chunks in admission order while room is left. The rows whose logits are
        sampled: one per sequence that has read all its tokens; and what the step evaluates
        (see `before`)."""
        batch = self.batch.batch
        batch.n_tokens = 0
        rows: list[tuple[Stream, int]] = []
        points: set[str] = set()

        def add(stream: Stream, tokens: list[int], sample: bool) -> None:
            slot = stream.slot
            assert slot is not None
            for tok in tokens:
                output = len(slot.cached) + 1 - stream.prompt_tokens  # which output token, if one
                points.add(f"token{output}" if output > 0 else "prompt")
                n = batch.n_tokens
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = tok, len(slot.cached), 1, 0
                batch.seq_id[n][0] = slot.id
                slot.cached.append(tok)
                batch.n_tokens += 1
            if sample:
                batch.logits[batch.n_tokens - 1] = 1
                rows.append((stream, batch.n_tokens - 1))
            slot.used = self.steps

        placed = [s for s in self.streams.values() if s.slot is not None]
        for stream in placed:
            if stream.next is not None:
                add(stream, [stream.next], True)
                stream.next = None
        for stream in placed:
            room, fed = self.n_batch - batch.n_tokens, stream.fed
            if room and fed < len(stream.tokens):
                chunk = stream.tokens[fed:fed + room]
                stream.evaluated += len(chunk)
                add(stream, chunk, fed + len(chunk) == len(stream.tokens))
        return rows, points

    def _sample(self, stream: Stream, row: int) -> Out:
        self.doing(GRAMMAR if stream.constrained else OTHER)
        if stream.constrained:
            self.before({"grammar"})
        try:
            tok = int(stream.sampler.sample(self.ctx, row))
        except DeadEnd:
            return self._end(stream, None, "dead_end")
        finally:
            self.doing(OTHER)
        if self.lib.llama_vocab_is_eog(self.llm._model.vocab, tok):
            return self._end(stream, None, "stop")
        stream.output_tokens += 1
        piece = self.llm.detokenize([tok])
        if stream.output_tokens >= stream.limit:
            return self._end(stream, tok, "length", piece)
        stream.next = tok
        return Out(stream.key, tok, piece, None)

    def _end(self, stream: Stream, tok: int | None, reason: str, piece: bytes = b"", keep: bool = True) -> Out:
        """Take a sequence out; its slot keeps its cells for reuse unless not `keep`."""
        del self.streams[stream.key]
        slot, stream.slot = stream.slot, None
        if slot is not None:
            slot.stream, slot.used = None, self.steps
            if not keep:
                self.lib.llama_memory_seq_rm(self.mem, slot.id, -1, -1)
                slot.cached = []
        return Out(stream.key, tok, piece, reason)
