"""Reading a `POST /v1/responses` body into a generation request, naming any bad field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.core import images, structured
from app.engine.request import ChatMessage, Request
from app.errors import InvalidRequest
from app.store.config import ON_RESTART

KNOWN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "stop",
         "metadata", "stream", "background", "store", "on_restart", "user", "text", "tools", "tool_choice",
         "parallel_tool_calls", "truncation", "reasoning", "include", "previous_response_id", "service_tier",
         "stream_options", "prompt_cache_key", "safety_identifier", "top_logprobs", "max_tool_calls",
         "raw", "suffix"}  # the last two: LMSP's, for Ollama's /api/generate
ROLES = {"system", "developer", "user", "assistant"}
EFFORTS = ("none", "minimal", "low", "medium", "high")  # "none": no reasoning (Qwen3's `enable_thinking` false)
CALL_ITEMS = {"function_call", "function_call_output"}
# Input items in one request. A conversation that long is far past any model's context here;
# the cap keeps the cost of reading a request (all of it in one 8 MiB body) small and linear.
MAX_ITEMS = 10_000


@dataclass(frozen=True)
class ResponseRequest:
    """A `POST /v1/responses` body, read: the generation `request` the engine runs (stored with the
    response as JSON), and what the response and its task keep in their own columns."""
    request: Request
    model: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    stream: bool
    background: bool
    on_restart: str | None
    store: bool = True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def text_of(content: Any, param: str) -> str:
    """A text-only content (a function's output): a string, or text parts (as OpenAI takes them), joined."""
    return _content(content, param, False)[0]


def _content(content: Any, param: str, images_too: bool) -> tuple[str, list[str]]:
    """A message's content: a string, or parts: its text parts joined, and its images (where
    `images_too`) as checked `data:` URLs (app/core/images.py)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise InvalidRequest("`content` must be a string or a list of content parts.", param=param)
    texts, shown = [], []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images_too and kind in ("input_image", "image_url"):
            shown.append(_image(part, f"{param}[{i}]"))
        elif kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise InvalidRequest(f"Only text{' and image' if images_too else ''} content parts are supported.",
                                 param=f"{param}[{i}]")
    return "".join(texts), shown


def _image(part: dict[str, Any], param: str) -> str:
    """Responses' `input_image` (`image_url`: a URL) or chat's `image_url` part (`image_url.url`)."""
    url = part.get("image_url")
    if isinstance(url, dict) and part["type"] == "image_url":
        return images.from_url(url.get("url"), f"{param}.image_url.url")
    if url is None and part.get("file_id") is not None:
        raise InvalidRequest("Files are not kept here: send the image as `image_url`, a data: URL.",
                             param=f"{param}.file_id", code="unsupported_image_url")
    return images.from_url(url, f"{param}.image_url")


def _messages(value: Any) -> list[ChatMessage]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("`input` must be a string or a non-empty list of messages.", param="input")
    if len(value) > MAX_ITEMS:
        raise InvalidRequest(f"`input` has {len(value)} items; at most {MAX_ITEMS} are allowed.", param="input")
    turns: list[tuple[str, list[str], list[str]]] = []  # each turn's role, texts and images, joined at the end
    calls: dict[str, str] = {}  # call_id -> the function of the first call with it, so far
    shown = 0
    for i, item in enumerate(value):
        if isinstance(item, dict) and item.get("type") in CALL_ITEMS:
            said = structured.item_message(item, calls, f"input[{i}]")
            # An assistant turn's calls (after its text), and then their results, are one turn
            # each: chat templates that refuse roles that do not alternate (Mistral-Instruct's,
            # Gemma's, Llama 2's) accept ordinary tool use.
            if turns and turns[-1][0] == said["role"]:
                turns[-1][1].append(said["content"])
            else:
                turns.append((said["role"], [said["content"]], []))
            continue
        if not isinstance(item, dict) or item.get("role") not in ROLES:
            raise InvalidRequest(f"Each message needs a role, one of {sorted(ROLES)}.", param=f"input[{i}].role")
        role = "system" if item["role"] == "developer" else item["role"]
        text, pictures = _content(item.get("content"), f"input[{i}].content", True)
        shown += len(pictures)
        if shown > images.MAX_IMAGES:
            raise InvalidRequest(f"The input has more than {images.MAX_IMAGES} images.", param=f"input[{i}].content",
                                 code="too_many_images")
        turns.append((role, [text], pictures))
    messages: list[ChatMessage] = []
    for role, texts, pictures in turns:
        message: ChatMessage = {"role": role, "content": "\n\n".join(texts)}
        if pictures:
            message["images"] = pictures
        messages.append(message)
    return messages


def parse(body: Any, convert: structured.Convert) -> ResponseRequest:
    """The request, checked; its schemas converted with `convert`. Costs time linear in the
    body, and up to the grammar worker's budget: run it off the event loop."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for key in body:
        if key not in KNOWN:
            raise InvalidRequest(f"Unknown parameter {key!r}.", param=key)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequest("`model` must be a model id.", param="model")
    if "input" not in body:
        raise InvalidRequest("`input` is required.", param="input")
    messages = _messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("`instructions` must be a string.", param="instructions")
        messages = [{"role": "system", "content": instructions}, *messages]
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or not 1 <= max_tokens <= 1_000_000):
        raise InvalidRequest("`max_output_tokens` must be an integer from 1 to 1000000.", param="max_output_tokens")
    temperature, top_p, seed, stop = _sampling(body)
    metadata, flags = _metadata(body), _flags(body)
    on_restart = body.get("on_restart")
    if on_restart is not None and on_restart not in ON_RESTART:
        raise InvalidRequest(f"`on_restart` must be one of {list(ON_RESTART)}.", param="on_restart")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidRequest("`previous_response_id` must be a response id.", param="previous_response_id")
    if flags["background"] and not flags["store"]:  # as OpenAI: a background response is fetched later
        raise InvalidRequest("A background response must be stored: `store: false` needs `background: false`.",
                             param="store")
    parts = structured.parse(body, convert)
    raw, suffix = _plain(body)
    request = Request(messages, instructions, temperature, top_p, seed, stop, parts.format, parts.tools,
                      parts.tool_choice, parts.constraint, parts.call, previous, raw=raw, suffix=suffix,
                      offer=parts.offer, effort=_effort(body.get("reasoning")))
    return ResponseRequest(request, model, max_tokens, metadata, flags["stream"], flags["background"], on_restart,
                           flags["store"])


def _effort(reasoning: Any) -> str:
    """`reasoning.effort`: how much a thinking model is to reason ("" as its template does)."""
    if reasoning is None:
        return ""
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(f"`reasoning.effort` must be one of {list(EFFORTS)}.", param="reasoning.effort")
    return effort or ""


def _plain(body: dict[str, Any]) -> tuple[bool, str | None]:
    """`raw` (the input is the prompt as the model reads it) and `suffix` (fill in the middle: the
    input is the text before the gap, this the text after it), checked: either takes one string
    as the input, and neither has a chat to go with it."""
    raw, suffix = body.get("raw", False), body.get("suffix")
    if not isinstance(raw, bool):
        raise InvalidRequest("`raw` must be true or false.", param="raw")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("`suffix` must be a string.", param="suffix")
    if not raw and suffix is None:
        return False, None
    name = "raw" if raw else "suffix"
    if raw and suffix is not None:
        raise InvalidRequest("`raw` and `suffix` cannot go together: a suffix is framed by the model's own tokens.",
                             param="suffix")
    if not isinstance(body.get("input"), str):
        raise InvalidRequest(f"With `{name}`, `input` must be one string.", param="input")
    for other in ("instructions", "previous_response_id", "tools"):
        if body.get(other):
            raise InvalidRequest(f"`{other}` cannot go with `{name}`: there is no chat template to put it in.",
                                 param=other)
    return raw, suffix


def _sampling(body: dict[str, Any]) -> tuple[float, float, int | None, list[str]]:
    """`temperature`, `top_p`, `seed` and `stop`, checked."""
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_number(temperature) or not 0 <= temperature <= 2:
        raise InvalidRequest("`temperature` must be a number from 0 to 2.", param="temperature")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest("`top_p` must be a number above 0 and at most 1.", param="top_p")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**32):
        raise InvalidRequest("`seed` must be an integer from 0 to 2^32-1.", param="seed")
    stop = [] if body.get("stop") is None else body["stop"]
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("`stop` must be a string or a list of up to 4 non-empty strings.", param="stop")
    return float(temperature), float(top_p), seed, stop


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    metadata = {} if body.get("metadata") is None else body["metadata"]
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()):
        raise InvalidRequest("`metadata` must be an object of up to 16 string keys (64 chars) and string values "
                             "(512 chars).", param="metadata")
    return metadata


def _flags(body: dict[str, Any]) -> dict[str, bool]:
    """`stream`, `background` and `store` (true unless said)."""
    flags = {}
    for name in ("stream", "background", "store"):
        flags[name] = body.get(name, name == "store")
        if flags[name] is None:
            flags[name] = name == "store"
        if not isinstance(flags[name], bool):
            raise InvalidRequest(f"`{name}` must be true or false.", param=name)
    return flags
