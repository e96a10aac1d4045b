"""Embeddings in the engine child (LMSP §12): a second llama.cpp context on the loaded model.

The model's weights are shared; the embeddings context adds only its own KV cache and compute
buffers, and is made on the first request, so a service that never embeds never pays for it.
The generation context is left alone: its prompt cache, which the next turn of a conversation
reuses, survives an embedding request. The pooling is the model's own where the file names one
(a sentence-embedding model) and the mean of the token embeddings where it has none (a
generative model such as SmolLM2). Vectors are cut to `dimensions` if asked, then L2-normalised.
It runs on the child's one thread, between generations, never during one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SEQUENCES = 64  # inputs decoded together in one batch (llama.cpp allows up to 256)


def _pooling(llm: Any) -> int:
    import llama_cpp

    arch = llm.metadata.get("general.architecture", "")
    own = int(llm.metadata.get(f"{arch}.pooling_type", llama_cpp.LLAMA_POOLING_TYPE_NONE))
    return llama_cpp.LLAMA_POOLING_TYPE_MEAN if own == llama_cpp.LLAMA_POOLING_TYPE_NONE else own


class Embedder:
    def __init__(self, llm: Any, n_threads: int) -> None:
        from llama_cpp import _internals, llama_cpp

        params = llama_cpp.llama_context_default_params()
        # Every input is decoded whole in one physical batch (pooling needs the whole sequence):
        # an input may be as long as the generation context, no longer.
        params.n_ctx = params.n_batch = params.n_ubatch = llm.n_ctx()
        params.n_seq_max = SEQUENCES
        params.kv_unified = True  # short inputs share the cache instead of n_ctx / SEQUENCES each
        params.embeddings = True
        params.pooling_type = _pooling(llm)
        params.n_threads = params.n_threads_batch = n_threads
        self.llm = llm
        self.limit = llm.n_ctx()
        self.ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=self.limit, embd=0, n_seq_max=SEQUENCES, verbose=False)

    def embed(self, texts: list[str], dimensions: int | None) -> dict[str, Any]:
        """{"ev": "embedded", "vectors": little-endian float32 bytes, row after row, "dims", "tokens"}
        or an error naming the input that does not fit."""
        n_embd = self.llm.n_embd()
        if dimensions is not None and dimensions > n_embd:
            return {"ev": "error", "code": "invalid_request", "param": "dimensions",
                    "message": f"`dimensions` must be at most {n_embd} for this model."}
        inputs = [self.llm.tokenize(text.encode(), add_bos=True, special=False) for text in texts]
        for i, tokens in enumerate(inputs):
            if len(tokens) > self.limit:
                return {"ev": "error", "code": "context_length_exceeded", "param": f"input[{i}]",
                        "message": f"input[{i}] is {len(tokens)} tokens; the model's context holds {self.limit}."}
        vectors = np.zeros((len(inputs), n_embd), dtype=np.float32)
        start = 0
        while start < len(inputs):
            end, size = start, 0
            while end < len(inputs) and end - start < SEQUENCES and size + len(inputs[end]) <= self.limit:
                size += len(inputs[end])
                end += 1
            vectors[start:end] = self._decode(inputs[start:end], n_embd)
            start = end
        vectors = vectors[:, :dimensions or n_embd]
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return {"ev": "embedded", "vectors": vectors.astype("<f4").tobytes(), "dims": vectors.shape[1],
                "tokens": sum(len(tokens) for tokens in inputs)}

    def _decode(self, inputs: list[list[int]], n_embd: int) -> np.ndarray:
        import llama_cpp

        self.ctx.kv_cache_clear()
        self.batch.reset()
        for seq, tokens in enumerate(inputs):
            self.batch.add_sequence(tokens, seq, True)  # every token an output: pooling reads them all
        self.ctx.decode(self.batch)
        return np.array([np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_seq(self.ctx.ctx, seq), shape=(n_embd,))
                         for seq in range(len(inputs))])

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
