"""Embeddings in the engine child (LMSP §12): a second llama.cpp context on the loaded model.

The model's weights are shared; the embeddings context adds only its own KV cache and compute
buffers, and is made on the first request, so a service that never embeds never pays for it.
The generation context is left alone: its prompt cache, which the next turn of a conversation
reuses, survives an embedding request. The pooling is the model's own where the file names one
(a sentence-embedding model) and the mean of the token embeddings where it has none (a
generative model such as SmolLM2). Vectors are cut to `dimensions` if asked, then L2-normalised.
It runs on the child's one thread, between generations, never during one.

Inputs are decoded in batches of SLICE tokens, short ones packed together: a cancel is seen
between two, within a second on a busy computer too (where a batch of 512 tokens took 15-35 s).
The batches are the same whatever the computer's pace, so the same texts give the same vectors.
A generative model's attention is causal, so a long input is cut into slices that carry on from
its cache, and this code sums its token embeddings itself (the mean, once normalised); a model
with its own pooling sees each input whole in one batch, as its pooling needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

SLICE = 64  # tokens per decode at most: what a cancel waits for (0.5-2.5 s beside a busy program)
SEQUENCES = SLICE  # inputs in one batch at most: llama.cpp wants no more sequences than a batch has tokens
BUDGET_CONTEXTS = 8  # a request's inputs together hold at most this many contexts' worth of tokens
TOKENIZE_CHECK = 64  # inputs tokenized between two looks for a cancel


def _pooling(llm: Any) -> int:
    import llama_cpp

    arch = llm.metadata.get("general.architecture", "")
    return int(llm.metadata.get(f"{arch}.pooling_type", llama_cpp.LLAMA_POOLING_TYPE_NONE))


class Embedder:
    def __init__(self, llm: Any, n_ctx: int, n_threads: int, piece_bytes: int) -> None:
        """`n_ctx`: the longest input, as long as a generation's context."""
        from llama_cpp import _internals, llama_cpp

        own = _pooling(llm)
        self.whole = own != llama_cpp.LLAMA_POOLING_TYPE_NONE  # the model pools: each input in one batch
        params = llama_cpp.llama_context_default_params()
        # An input as long as the generation context may end in a batch after others began:
        # room for both in the cache.
        params.n_ctx = n_ctx + SLICE
        params.n_batch = params.n_ubatch = n_ctx if self.whole else SLICE
        params.n_seq_max = SEQUENCES
        params.kv_unified = True  # short inputs share the cache instead of n_ctx / SEQUENCES each
        params.embeddings = True
        params.pooling_type = own
        params.n_threads = params.n_threads_batch = n_threads
        self.llm = llm
        self.limit = n_ctx
        self.piece_bytes = piece_bytes
        self.ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=params.n_batch, embd=0, n_seq_max=1, verbose=False)

    def embed(self, texts: list[str], dimensions: int | None, threads: int, stop: Callable[[], bool]
              ) -> dict[str, Any]:
        """{"ev": "embedded", "vectors": little-endian float32 bytes, row after row, "dims", "tokens"},
        an error naming the input that does not fit, or {"ev": "cancelled"} once `stop()` says so.
        `threads`: how many generation decodes on now (app/engine/child/threads.py), one beside a busy
        program: there two threads stalled a batch of one to seven tokens for 1-2 s, one took 0.1-0.2 s."""
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.ctx.ctx, threads, threads)
        n_embd = self.llm.n_embd()
        if dimensions is not None and dimensions > n_embd:
            return {"ev": "error", "code": "invalid_request", "param": "dimensions",
                    "message": f"`dimensions` must be at most {n_embd} for this model."}
        inputs = self._tokenize(texts, stop)
        if not isinstance(inputs, list):
            return inputs
        sums = np.zeros((len(inputs), n_embd), dtype=np.float64)
        self.ctx.kv_cache_clear()  # a request cancelled midway left its inputs' cache
        for pieces in self._batches(inputs):
            if stop():
                return {"ev": "cancelled"}
            self._decode(pieces, inputs, sums)
        vectors = sums[:, :dimensions or n_embd]
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return {"ev": "embedded", "vectors": vectors.astype("<f4").tobytes(), "dims": vectors.shape[1],
                "tokens": sum(len(tokens) for tokens in inputs)}

    def _tokenize(self, texts: list[str], stop: Callable[[], bool]) -> list[list[int]] | dict[str, Any]:
        """The inputs' tokens, or why they cannot be embedded: one longer than the context (refused
        unread where its bytes alone say so), or all together over the request's budget (refused
        as soon as the count passes it)."""
        budget = BUDGET_CONTEXTS * self.limit
        inputs, total = [], 0
        for i, text in enumerate(texts):
            if i % TOKENIZE_CHECK == TOKENIZE_CHECK - 1 and stop():
                return {"ev": "cancelled"}
            raw = text.encode()
            least = len(raw) // self.piece_bytes
            tokens = self.llm.tokenize(raw, add_bos=True, special=False) if least <= self.limit else []
            if least > self.limit or len(tokens) > self.limit:
                return {"ev": "error", "code": "context_length_exceeded", "param": f"input[{i}]",
                        "message": f"input[{i}] is {max(least, len(tokens))} tokens or more; the model's "
                                   f"context holds {self.limit}."}
            total += len(tokens)
            if total > budget:
                return {"ev": "error", "code": "too_many_tokens", "param": "input",
                        "message": f"The inputs are more than {budget} tokens together (input[0] to input[{i}] "
                                   f"alone are {total}); send at most {budget} per request."}
            inputs.append(tokens)
        return inputs

    def _batches(self, inputs: list[list[int]]) -> Iterator[list[tuple[int, int, int]]]:
        """Lists of (input, start, end): runs of tokens to decode together, in order, SLICE
        tokens at most. Inputs are cut into slices unless the model pools
        them whole: then one that does not fit the room left starts a batch, alone if longer."""
        pieces: list[tuple[int, int, int]] = []
        size = 0
        for index, tokens in enumerate(inputs):
            start = 0
            while start < len(tokens):
                if size >= SLICE or len(pieces) == SEQUENCES or (
                        self.whole and pieces and size + len(tokens) > SLICE):
                    yield pieces
                    pieces, size = [], 0
                end = len(tokens) if self.whole else min(len(tokens), start + SLICE - size)
                pieces.append((index, start, end))
                size, start = size + end - start, end
        if pieces:
            yield pieces

    def _decode(self, pieces: list[tuple[int, int, int]], inputs: list[list[int]], sums: np.ndarray) -> None:
        """Decode one batch and add what it yields to `sums`: each finished input's pooled vector
        (whole inputs), or every token's embedding (sliced ones; their sum points where their mean
        does). An input's sequence is its index modulo SEQUENCES: a batch holds at most that many
        inputs in a row, and one that goes on into the next batch keeps its cache there."""
        import llama_cpp

        b = self.batch.batch
        b.n_tokens = 0
        for index, start, end in pieces:
            for pos in range(start, end):
                j = b.n_tokens
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = inputs[index][pos], pos, 1, True
                b.seq_id[j][0] = index % SEQUENCES
                b.n_tokens += 1
        self.ctx.decode(self.batch)
        n_embd = sums.shape[1]
        rows = None if self.whole else np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(self.ctx.ctx),
                                                            shape=(b.n_tokens, n_embd))
        row = 0
        for index, start, end in pieces:
            if rows is None:
                sums[index] = np.ctypeslib.as_array(
                    llama_cpp.llama_get_embeddings_seq(self.ctx.ctx, index % SEQUENCES), shape=(n_embd,))
            else:
                sums[index] += rows[row:row + end - start].sum(axis=0, dtype=np.float64)
                row += end - start
            if rows is not None and end == len(inputs[index]):  # finished: room for the next inputs
                self.ctx.kv_cache_seq_rm(index % SEQUENCES, -1, -1)
        if rows is None:
            self.ctx.kv_cache_clear()  # (a model that pools may have no cache to cut up)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
