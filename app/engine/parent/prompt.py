"""What a llama-server is sent: a request's prompt as token ids and its sampling (`Prompter`, `body`),
and texts to embed (`embed`).

The chat template is rendered here, as the check made when a request is accepted renders it
(app/engine/template.py), with each message's text as a slot; the server tokenizes the pieces, the
template's own markers as special tokens and the messages' text as plain text. The pieces are
tokenized at once (the server has a thread per connection), the template's remembered: they recur.
A conversation with images is sent as llama.cpp's multimodal prompt instead: the same pieces as
one text, the server's media marker before a message's text for each of its images, and the
images (its text is then read with special tokens, so one that spells them is refused).
Embeddings: vectors of the model's pooling (the mean of the token embeddings where the file names
none), L2-normalised by the server, cut to `dimensions` and normalised again here.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from app.engine import call_forms
from app.engine.constraints import grammar
from app.engine.registry import gguf
from app.engine.request import ChatMessage, Constraint, Request, payload, thought
from app.engine.template import BREAK, SLOTS, ChatTemplate, Refused

Message = dict[str, Any]
KNOWN = 256  # template pieces remembered as tokens
BUDGET_CONTEXTS = 8  # a request's inputs together hold at most this many contexts' worth of tokens
GROUP = 16  # inputs tokenized at once while counting
# The sampler chain of llama.cpp's own defaults reduced to what a request sets (greedy at
# temperature 0): every other sampler llama-server would add is switched off explicitly.
SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]
NEUTRAL = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "repeat_last_n": 0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
           "top_n_sigma": -1.0, "mirostat": 0, "n_probs": 0, "ignore_eos": False, "n_keep": 0}
PATTERN = 2  # llama.cpp's COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN: a regex over the answer so far


def _error(code: str, message: str, param: str | None = None) -> Exception:
    from app.engine.runs import EngineError  # the engine's error, raised for it

    return EngineError(code, message, param)


class Prompter:
    """A loaded model's prompt maker: its chat template (None: "role: text" lines), the tokens the
    model puts first by itself where there is no template, each slot's context."""

    def __init__(self, template: ChatTemplate | None, first: list[int], n_ctx: int, token_bytes: int,
                 fim: tuple[int, int, int] | None = None, marker: str | None = None) -> None:
        self.template = template
        self.first = first
        self.n_ctx = n_ctx
        self.token_bytes = token_bytes  # gguf.GgufInfo.token_bytes: a text's least tokens, from its bytes
        self.fim = fim  # gguf.GgufInfo.fim: the prefix, suffix and middle tokens
        # Where an image goes in a multimodal prompt: the server's own marker, random to each
        # start (no text can guess it); None without a vision projector.
        self.marker = marker
        self._known: dict[str, list[int]] = {}

    @classmethod
    async def of(cls, server: Any, info: gguf.GgufInfo) -> Prompter:
        props = json.loads(await server.get("/props"))
        template = None
        if info.has_chat_template:  # the file's own text; the server's copy where it is too long to read here
            template = ChatTemplate(info.chat_template or props.get("chat_template", ""),
                                    props.get("bos_token", ""), props.get("eos_token", ""))
        first = await tokenize(server, "", special=True, add=True)
        marker = props.get("media_marker") if (props.get("modalities") or {}).get("vision") else None
        return cls(template, first, int(props["default_generation_settings"]["n_ctx"]), info.token_bytes, info.fim,
                   marker)

    async def ids(self, server: Any, request: Request, text: str) -> tuple[list[int], list[int]]:
        """The prompt's tokens, and those of `text` (the output so far). EngineError when the
        template refuses the conversation or the prompt cannot fit the context."""
        if request.raw or request.suffix is not None:
            return await self._plain(server, request, text)
        pieces, messages, first = self._layout(request)
        parts = await self._parts(server, pieces, messages, first, text)
        return self._whole(first + [t for part in parts[:-1] for t in part]), parts[-1]

    async def sent(self, server: Any, request: Request, text: str) -> tuple[Any, int, list[int]]:
        """What `/completion` is sent as its prompt (ending with `text`, the output so far), how
        many of its tokens are counted here, and those of `text`. Token ids, unless the messages
        show images: then llama.cpp's multimodal prompt, one text with the server's media marker
        where each image goes (before its message's text) and the images, whose tokens the server
        counts (its context check refuses a prompt they make too long)."""
        if not request.images:
            ids, more = await self.ids(server, request, text)
            return ids + more, len(ids), more
        if self.marker is None:  # refused when accepted: app/core/templates.py
            raise _error("invalid_request", "This model has no vision projector, so it cannot be shown images.",
                         "input")
        pieces, messages, first = self._layout(request)
        parts = await self._parts(server, pieces, messages, first, text)
        known = self._whole(first + [t for part in parts[:-1] for t in part])
        await self._plain_only(server, [messages[int(p)]["content"] for p in pieces[1::2]] + [text],
                               [*parts[1:-1:2], parts[-1]])
        shown = [image for p in pieces[1::2] for image in messages[int(p)].get("images", [])]
        prompt = "".join(self.marker * len(messages[int(p)].get("images", [])) + messages[int(p)]["content"]
                         if k % 2 else p.replace(BREAK, "") for k, p in enumerate(pieces))  # one text: no breaks
        if self.first and self.template is not None and self.template.bos_token:
            prompt = prompt.removeprefix(self.template.bos_token)  # the server puts the model's first tokens
        return {"prompt_string": prompt + text, "multimodal_data": [payload(i) for i in shown]}, len(known), parts[-1]

    def _layout(self, request: Request) -> tuple[list[str], list[ChatMessage], list[int]]:
        """The prompt as pieces, template text and message index by turns; the messages; the
        tokens put before them (the model's own first ones where there is no template)."""
        if self.template is not None:  # it writes the BOS token where it wants one
            try:
                prompt, messages = self.template.prompt(request)
            except Refused as exc:  # most are refused when accepted: app/core/templates.py
                raise _error("template_error", str(exc)) from None
            return SLOTS.split(prompt), messages, []
        messages = request.prompt()
        pieces = [x for i, m in enumerate(messages) for x in (("\n" if i else "") + f"{m['role']}: ", str(i))]
        return [*pieces, "\nassistant: "], messages, self.first

    async def _parts(self, server: Any, pieces: list[str], messages: list[ChatMessage], first: list[int],
                     text: str) -> list[list[int]]:
        """The tokens of each piece, then of `text`, if they can fit the context."""
        self._fits(len(first), (messages[int(p)]["content"] if k % 2 else p for k, p in enumerate(pieces)))
        return list(await asyncio.gather(*(self._piece(server, messages, k, p) for k, p in enumerate(pieces)),
                                         tokenize(server, text) if text else _none()))

    @staticmethod
    async def _plain_only(server: Any, texts: list[str], plain: list[list[int]]) -> None:
        """EngineError if a text spells one of the model's control tokens: a multimodal prompt is
        one text, read with its special tokens, where it would be that token (token ids keep a
        message's text plain)."""
        special = await asyncio.gather(*(tokenize(server, t, special=True) if t else _none() for t in texts))
        if any(a != b for a, b in zip(special, plain)):
            raise _error("invalid_request", "A conversation with images cannot spell the model's control tokens "
                         "(such as <|im_end|>) in its text: llama.cpp reads its prompt as one text.", "input")

    async def _plain(self, server: Any, request: Request, text: str) -> tuple[list[int], list[int]]:
        """A prompt without a template: a raw one as it is (its special tokens read as such, the
        model's first tokens where it puts them), or the text before a gap and the `suffix` after
        it in the model's fill-in-the-middle tokens (as llama.cpp's /infill frames them)."""
        prompt = request.messages[-1]["content"]
        self._fits(len(self.first) + (0 if request.raw else 3), (prompt, request.suffix or ""))  # 3: the FIM tokens
        output = tokenize(server, text) if text else _none()
        if request.raw:
            ids, out = await asyncio.gather(tokenize(server, prompt, special=True, add=True), output)
            return self._whole(ids), out
        if self.fim is None:  # refused when accepted: app/core/templates.py
            raise _error("unsupported_suffix", "This model has no fill-in-the-middle tokens.", "suffix")
        pre, suf, mid = self.fim
        before, after, out = await asyncio.gather(tokenize(server, prompt), tokenize(server, request.suffix or ""),
                                                  output)
        return self._whole([*self.first, pre, *before, suf, *after, mid]), out

    def _fits(self, fixed: int, texts: Iterable[str]) -> None:
        """EngineError unless the prompt, `fixed` tokens and `texts`, can fit the context: a prompt
        that cannot is refused unread (200,000 messages would be as many requests to the server,
        8 MiB of text millions of token ids to read back)."""
        least = fixed + sum(self.least(t) for t in texts)
        if least >= self.n_ctx:
            raise _error("context_length_exceeded", f"The input is at least {least} tokens; the model's context "
                                                     f"holds {self.n_ctx}.")

    def _whole(self, ids: list[int]) -> list[int]:
        """The prompt's tokens, if they fit the context (EngineError if not)."""
        if len(ids) >= self.n_ctx:
            raise _error("context_length_exceeded", f"The input is {len(ids)} tokens; the model's context "
                                                     f"holds {self.n_ctx}.")
        return ids

    def least(self, text: str) -> int:
        """The fewest tokens `text` can be (none if it is empty)."""
        return least_tokens(len(text.encode()), self.token_bytes) if text else 0

    async def _piece(self, server: Any, messages: list[ChatMessage], k: int, piece: str) -> list[int]:
        if k % 2:
            return await tokenize(server, messages[int(piece)]["content"]) if messages[int(piece)]["content"] else []
        if piece not in self._known:
            if len(self._known) >= KNOWN:
                self._known.clear()
            self._known[piece] = [t for part in piece.split(BREAK) if part
                                  for t in await tokenize(server, part, special=True)]
        return self._known[piece]


def least_tokens(size: int, token_bytes: int) -> int:
    """The fewest tokens a text of `size` bytes can be: a token at least, and no token stands for
    more bytes than the longest of the vocabulary (`token_bytes`; 0: unknown)."""
    return max(1, size // token_bytes) if token_bytes else 1


async def _none() -> list[int]:
    return []


async def tokenize(server: Any, text: str, special: bool = False, add: bool = False) -> list[int]:
    answer = await server.post("/tokenize", {"content": text, "add_special": add, "parse_special": special})
    return [int(t) for t in answer["tokens"]]


def body(request: Request, prompt: Any, n_predict: int, text: str) -> dict[str, Any]:
    """A streamed `/completion` of `prompt` (`Prompter.sent`: ending with `text`, the output so far),
    sampled as the request asks."""
    sent = {"prompt": prompt, "n_predict": n_predict, "stream": True, "cache_prompt": True, "samplers": SAMPLERS,
            "temperature": float(request.temperature), "top_p": float(request.top_p),
            "seed": -1 if request.seed is None else request.seed, "stop": request.stop, **NEUTRAL}
    if request.constraint:
        sent["grammar"] = grammar.gbnf(request.constraint)
        if text:
            # The grammar first reads the output so far (llama.cpp feeds a `generation_prompt` to a
            # grammar of the kinds it makes itself: "tool_calls" is the one its API names), so a
            # resumed structured answer carries on from it and still ends as valid JSON.
            sent.update(grammar_type="tool_calls", generation_prompt=text)
    elif request.offer is not None:
        sent.update(_offered(request, request.offer, text))
    return sent


def _offered(request: Request, offer: Constraint, text: str) -> dict[str, Any]:
    """The grammar of a call the model is offered, in its template's form (app/engine/call_forms.py):
    it binds the answer once it opens as a call (a lazy grammar, triggered there, after the
    model's reasoning if it reasons), at once if the answer so far opened a call (which it first
    reads, as a structured answer's), and not at all once the answer is text."""
    read = thought(request, text)
    answer = None if read is None else read[1]
    form = call_forms.of(request)
    opened = None if answer is None else form.opens(answer)
    if opened is False:
        return {}
    call = form.grammar(offer)
    if opened:
        return {"grammar": call, "grammar_type": "tool_calls", "generation_prompt": answer}
    # The marks are single tokens in some vocabularies (Qwen's, Llama's, Mistral's): preserved,
    # they are streamed as text.
    return {"grammar": call, "grammar_lazy": True, "preserved_tokens": list(form.preserved),
            "grammar_triggers": [{"type": PATTERN, "value": start} for start in form.triggers(bool(request.reasoning))]}


def pooling(info: gguf.GgufInfo) -> int:
    """The model's own pooling type (0: none, then the mean is taken)."""
    value = info.metadata.get(f"{info.architecture}.pooling_type", 0)
    return int(value) if isinstance(value, int) else 0


def embedding_size(info: gguf.GgufInfo) -> int:
    value = info.metadata.get(f"{info.architecture}.embedding_length", 0)
    return int(value) if isinstance(value, int) else 0


async def embed(server: Any, texts: list[str], dimensions: int | None, info: gguf.GgufInfo, limit: int) -> Message:
    """{"ev": "embedded", "vectors": little-endian float32 bytes, row after row, "dims", "tokens"},
    or an error naming what does not fit: an input longer than the context, or all of them over the
    request's budget. What the bytes alone say is refused unread (the model's `info.token_bytes`);
    tokens are counted only where they leave a doubt, a few inputs at a time and no
    further than the first that does not fit."""
    size, token_bytes = embedding_size(info), info.token_bytes
    if dimensions is not None and dimensions > size:
        return {"ev": "error", "code": "invalid_request", "param": "dimensions",
                "message": f"`dimensions` must be at most {size} for this model."}
    sizes = [len(t.encode()) for t in texts]
    least = [least_tokens(n, token_bytes) for n in sizes]
    most = [n + 2 for n in sizes]  # a token is a byte of text at least, and two may be added
    refused = _over(least, limit, "or more")
    if refused is None and (max(most, default=0) > limit or sum(most) > BUDGET_CONTEXTS * limit):
        refused = await _counted(server, texts, limit)
    if refused is not None:
        return refused
    answer = await server.post("/v1/embeddings", {"input": texts, "encoding_format": "base64"})
    # Decoded and normalised off the event loop: 2,048 vectors are megabytes of base64.
    vectors = await asyncio.to_thread(_vectors, answer["data"], len(texts), dimensions)
    return {"ev": "embedded", "vectors": vectors.astype("<f4").tobytes(), "dims": vectors.shape[1],
            "tokens": int(answer.get("usage", {}).get("prompt_tokens", 0))}


def _vectors(rows: list[dict[str, Any]], n: int, dimensions: int | None) -> Any:
    """The rows' vectors (base64 float32), cut to `dimensions` and L2-normalised again."""
    ordered = sorted(rows, key=lambda row: row["index"])
    vectors = np.array([np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in ordered],
                       dtype=np.float64).reshape(n, -1)
    vectors = vectors[:, :dimensions or vectors.shape[1]]
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return vectors


def _over(counts: list[int], limit: int, hedge: str) -> Message | None:
    """The error for the first input over the context, or for the inputs over the request's budget."""
    budget, total = BUDGET_CONTEXTS * limit, 0
    for i, n in enumerate(counts):
        if n > limit:
            return {"ev": "error", "code": "context_length_exceeded", "param": f"input[{i}]",
                    "message": f"input[{i}] is {n} tokens {hedge}; the model's context holds {limit}."}
        total += n
        if total > budget:
            return {"ev": "error", "code": "too_many_tokens", "param": "input",
                    "message": f"The inputs are more than {budget} tokens together (input[0] to input[{i}] "
                               f"alone are {total}); send at most {budget} per request."}
    return None


async def _counted(server: Any, texts: list[str], limit: int) -> Message | None:
    """The inputs' tokens counted, GROUP at a time, until one of them or their sum does not fit."""
    counts: list[int] = []
    for start in range(0, len(texts), GROUP):
        counts += [len(ids) for ids in await asyncio.gather(
            *(tokenize(server, t, add=True) for t in texts[start:start + GROUP]))]
        refused = _over(counts, limit, "long")
        if refused is not None:
            return refused
    return None
