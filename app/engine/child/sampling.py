"""Sampling under a grammar, at the speed of sampling without one (engine child only).

llama-cpp-python puts the grammar into the sampler chain, where it checks every token of the
vocabulary at every step: with SmolLM2's 49 152 tokens that made decoding ~13x slower. This
is what llama.cpp's own common sampler does instead: sample without the grammar, then ask the
grammar about that one token; only when it refuses, filter the whole vocabulary and sample
again. The result is the same token under greedy decoding (the best token, if allowed, is
the best allowed token) and the same distribution when sampling (accept-or-resample draws from
the allowed tokens in proportion to their probability), so resume stays exact.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any


class DeadEnd(Exception):
    """The grammar allows no token: the output so far cannot be finished."""


DEAD_END = "The schema allows no further text here (e.g. a `pattern` that matches nothing)."


class GrammarSampler:
    def __init__(self, llm: Any, chain: Any, gbnf: str) -> None:
        import llama_cpp
        from llama_cpp._internals import LlamaTokenDataArray

        self.lib = llama_cpp
        self.chain = chain  # a LlamaSampler without the grammar (Llama._init_sampler)
        self.grammar = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, gbnf.encode(), b"root")
        if not self.grammar:
            raise ValueError("llama.cpp could not parse the grammar.")
        self.n_vocab = llm.n_vocab()
        self.all = LlamaTokenDataArray(n_vocab=self.n_vocab)
        # Its fields take Python numbers, which llama_cpp's annotations (ctypes types) do not say.
        self.one: Any = (llama_cpp.llama_token_data * 1)()

    def __del__(self) -> None:
        if getattr(self, "grammar", None):
            self.lib.llama_sampler_free(self.grammar)

    def accept(self, token: int) -> None:
        """Advance past a token already produced (resume): the chain and the grammar."""
        self.chain.accept(token)
        self.lib.llama_sampler_accept(self.grammar, token)

    def allows(self, token: int) -> bool:
        self.one[0].id, self.one[0].logit, self.one[0].p = token, 0.0, 0.0
        single = self.lib.llama_token_data_array(data=ctypes.cast(self.one, self.lib.llama_token_data_p), size=1,
                                                 selected=-1, sorted=False)
        self.lib.llama_sampler_apply(self.grammar, ctypes.byref(single))
        return not math.isinf(self.one[0].logit)

    def sample(self, ctx: Any, idx: int = -1) -> int:
        import numpy as np

        # The chain accepts what it draws, refused or not: its only member with state, the
        # penalties, is neutral here (repeat 1, frequency and presence 0).
        token = self.chain.sample(ctx, idx)
        if not self.allows(token):
            logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx.ctx, idx), shape=(self.n_vocab,))
            self.all.copy_logits(logits)
            candidates = ctypes.byref(self.all.candidates)
            self.lib.llama_sampler_apply(self.grammar, candidates)
            if np.isneginf(self.all.candidates_data.logit[:self.all.candidates.size]).all():
                # Sampling would still pick a token, and llama.cpp aborts the process when the
                # grammar is told to accept it ("Unexpected empty grammar stack").
                raise DeadEnd(DEAD_END)
            self.lib.llama_sampler_apply(self.chain.sampler, candidates)
            token = int(self.all.candidates.data[self.all.candidates.selected].id)
        self.lib.llama_sampler_accept(self.grammar, token)
        return token


def sampler_for(llm: Any, temperature: float, top_p: float, gbnf: str | None, prefix: list[int]) -> Any:
    """The sampler chain `Llama.generate` would build (llama.cpp's own chain: greedy at
    temperature 0, else top-p, temperature and a draw seeded with `llm`'s seed), under the
    grammar if there is one, advanced over the tokens already produced (a resumed task), so the
    output carries on from where it stands and still ends as valid JSON. Raises ValueError for
    a grammar llama.cpp cannot parse."""
    sampler = llm._init_sampler(temp=temperature, top_p=top_p, top_k=0, min_p=0.0, repeat_penalty=1.0)
    if gbnf:
        sampler = GrammarSampler(llm, sampler, gbnf)
    for tok in prefix:
        sampler.accept(tok)
    return sampler
