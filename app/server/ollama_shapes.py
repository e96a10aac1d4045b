"""Ollama's request and answer shapes (LMSP §15), translated to and from ours: a chat or generate
body becomes a Responses request (the one the core runs for every surface), a finished response
becomes Ollama's message, a model object Ollama's model. No HTTP here (app/server/ollama.py)."""

from __future__ import annotations

import json
import math
import re
import time
from collections import OrderedDict, deque
from datetime import UTC, datetime, timedelta
from pathlib import PurePath
from typing import Any

from app.core import images
from app.core.ollama import MAX_KEEP_ALIVE, ollama_name
from app.core.requests import MAX_ITEMS, text_of
from app.core.structured import chat_tool
from app.display import gpu_share
from app.errors import InvalidRequest, LmspError
from app.server import go_template

# Ollama `options` that have a Responses field; the others (top_k, num_ctx, repeat_penalty...) are
# the service's to choose, and are ignored as Ollama ignores options a model does not use.
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
           "num_predict": "max_output_tokens"}
MAX_STOPS = 4
FOREVER = 100 * 365 * 86400  # seconds: what `/api/ps` says of a model kept until it is unloaded
QUANT = re.compile(r"(?i)(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])")


def iso(seconds: float) -> str:
    """A time as Ollama writes it: RFC 3339 in UTC."""
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _string(value: Any, param: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"`{param}` must be a string.", param=param)
    return value


def _images(message: dict[str, Any], param: str) -> list[dict[str, Any]]:
    """A message's (or a generate body's) `images`, base64 each, as Responses' image parts: checked
    here, so an error names the Ollama field."""
    shown = message.get("images") or []
    if not isinstance(shown, list):
        raise InvalidRequest("`images` must be a list of base64 strings.", param=param)
    return [{"type": "input_image", "image_url": images.checked(data, f"{param}[{j}]")} for j, data in enumerate(shown)]


def _shown(content: str, parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content as Responses reads it: its text, after its images if it has any."""
    return [*parts, {"type": "input_text", "text": content}] if parts else content


class _Unanswered:
    """The tool calls not answered yet, in order: the earliest of a function, or of all, found in
    constant time, so that matching a conversation's tool messages costs time linear in it."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, str] = OrderedDict()  # call number -> its function, unanswered
        self._by_name: dict[str, deque[int]] = {}  # function -> its unanswered call numbers
        self._ids: list[str] = []  # call number -> call id

    def add(self, call_id: str, name: str) -> None:
        self._order[len(self._ids)] = name
        self._by_name.setdefault(name, deque()).append(len(self._ids))
        self._ids.append(call_id)

    def answer(self, name: Any) -> str | None:
        """The id of the earliest unanswered call of `name` (of any function when None), now answered."""
        if name is None:
            if not self._order:
                return None
            number, called = self._order.popitem(last=False)
            self._by_name[called].popleft()  # the earliest of all is the earliest of its function
            return self._ids[number]
        numbers = self._by_name.get(name) if isinstance(name, str) else None
        if not numbers:
            return None
        number = numbers.popleft()
        del self._order[number]
        return self._ids[number]


def _calls(message: dict[str, Any], i: int, unanswered: _Unanswered) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as function_call items. Ollama's calls have no ids (its
    tool messages name the function instead): each gets one, and is remembered as unanswered."""
    calls = message["tool_calls"]
    items = []
    for j, call in enumerate(calls):
        param = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest("A tool call is {\"function\": {\"name\", \"arguments\"}}.", param=param)
        arguments = fn.get("arguments") or {}
        call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}_{j}"
        items.append({"type": "function_call", "call_id": call_id, "name": fn["name"],
                      "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)})
        unanswered.add(call_id, fn["name"])
    return items


def _answer(message: dict[str, Any], i: int, unanswered: _Unanswered) -> dict[str, Any]:
    """A tool message as the output of the earliest unanswered call of its function (`tool_name`),
    or of the earliest unanswered call when it names none."""
    call_id = unanswered.answer(message.get("tool_name") or message.get("name"))
    if call_id is None:
        raise InvalidRequest("A tool message must answer a tool call of an earlier assistant message.",
                             param=f"messages[{i}]")
    return {"type": "function_call_output", "call_id": call_id,
            "output": text_of(message.get("content") or "", f"messages[{i}].content")}


def _capped(param: str, count: int, what: str = "items") -> None:
    if count > MAX_ITEMS:
        raise InvalidRequest(f"`{param}` has {count} {what}; at most {MAX_ITEMS} are allowed.", param=param)


def _counted(messages: Any) -> list[Any]:
    """`messages`, held to the item cap of every request (`MAX_ITEMS`) before any of them is read:
    the messages, and apart the tool calls they make (each becomes an item of its own)."""
    if not isinstance(messages, list):
        raise InvalidRequest("`messages` must be a list of messages.", param="messages")
    _capped("messages", len(messages))
    calls = 0
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls"):
            if not isinstance(message["tool_calls"], list):
                raise InvalidRequest("`tool_calls` must be a list.", param=f"messages[{i}].tool_calls")
            calls += len(message["tool_calls"])
    _capped("messages", calls, "tool calls")
    return messages


def _input(messages: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    unanswered = _Unanswered()
    for i, message in enumerate(_counted(messages)):
        if not isinstance(message, dict):
            raise InvalidRequest("A message is an object with `role` and `content`.", param=f"messages[{i}]")
        parts = _images(message, f"messages[{i}].images")
        if message.get("role") == "tool":
            if parts:  # a function's output is text
                raise InvalidRequest("A tool message cannot show images.", param=f"messages[{i}].images")
            items.append(_answer(message, i, unanswered))
            continue
        content = _string(message.get("content"), f"messages[{i}].content")
        if message.get("role") == "assistant" and message.get("tool_calls"):
            said = [{"role": "assistant", "content": _shown(content, parts)}] if content or parts else []
            items += said + _calls(message, i, unanswered)
        else:
            items.append({"role": message.get("role"), "content": _shown(content, parts)})
    return items


def _format(value: Any) -> dict[str, Any] | None:
    if value in (None, ""):
        return None
    if value == "json":
        return {"format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"format": {"type": "json_schema", "name": "ollama", "schema": value, "strict": True}}
    raise InvalidRequest("`format` must be \"json\" or a JSON schema.", param="format")


def _options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("`options` must be an object.", param="options")
    out = {ours: options[theirs] for theirs, ours in OPTIONS.items() if options.get(theirs) is not None}
    if isinstance(out.get("max_output_tokens"), int) and out["max_output_tokens"] < 0:
        del out["max_output_tokens"]  # -1: no limit, -2: fill the context; the context is the limit here
    if isinstance(out.get("stop"), list):
        # Ollama takes any number of stop sequences (editors send a dozen special tokens for a fill in
        # the middle); the engine ends on up to four, the first ones given.
        out["stop"] = out["stop"][:MAX_STOPS]
    return out


def _common(body: dict[str, Any], model_id: str, items: list[dict[str, Any]] | str) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model_id, "input": items, "stream": False, "background": False,
                           **_options(body)}
    text = _format(body.get("format"))
    if text is not None:
        out["text"] = text
    think = body.get("think")
    if think is not None:  # Ollama's: true, false, or GPT-OSS's "low" / "medium" / "high"
        if think not in (True, False, "low", "medium", "high"):
            raise InvalidRequest('`think` must be true, false, "low", "medium" or "high".', param="think")
        out["reasoning"] = {"effort": "none" if think is False else "medium" if think is True else think}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise InvalidRequest("`tools` must be a list.", param="tools")
        _capped("tools", len(tools))
        out["tools"] = [chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    return out


def chat_request(body: dict[str, Any], model_id: str) -> dict[str, Any]:
    """An Ollama chat body as a Responses request for the model `model_id`."""
    return _common(body, model_id, _input(body.get("messages")))


def generate_request(body: dict[str, Any], model_id: str) -> dict[str, Any]:
    """An Ollama generate body (`prompt`, `suffix`, `system`, `raw`, `template`) as a Responses
    request: a `raw` prompt is sent as it is (Ollama then leaves `system`, `suffix` and `template`
    out too: an app that sends both, as Continue does, wrote its own fill-in-the-middle prompt), a
    `suffix` in the model's fill-in-the-middle tokens, a `template` rendered over `system` and
    `prompt` (app/server/go_template.py) and sent as a raw prompt; a prompt otherwise goes through
    the model's own chat template."""
    prompt, suffix = _string(body.get("prompt"), "prompt"), _string(body.get("suffix"), "suffix")
    raw, template = body.get("raw", False), _string(body.get("template"), "template")
    system = _string(body.get("system"), "system")
    parts = _images(body, "images")
    if parts and (raw is not False or suffix or template):
        raise InvalidRequest("`images` need the model's own chat template: they cannot go with `raw`, `suffix` "
                             "or `template`.", param="images")
    if template and raw is False:
        if suffix:
            raise InvalidRequest("`suffix` cannot go with `template` here: the template has no `.Suffix`.",
                                 param="suffix")
        return {**_common(body, model_id, go_template.render(template, system, prompt)), "raw": True}
    if raw is not False or suffix:  # `raw` as sent: reading the Responses request checks it
        out = _common(body, model_id, prompt)
        out.update({"raw": raw} if raw is not False else {"suffix": suffix})
        return out
    out = _common(body, model_id, [{"role": "user", "content": _shown(prompt, parts)}])
    if system:
        out["instructions"] = system
    return out


class OllamaNames:
    """An error about the translated request, in the terms of the Ollama body the client sent."""
    RENAMES = {"max_output_tokens": "options.num_predict", "temperature": "options.temperature",
               "top_p": "options.top_p", "seed": "options.seed", "stop": "options.stop", "instructions": "system"}

    def __init__(self, messages: str) -> None:
        self.messages = messages  # what the input came from: `messages` or `prompt`

    def name(self, field: str) -> str:
        if field.startswith("text.format"):
            return "format"
        if field.startswith("input"):
            return self.messages + field[len("input"):] if self.messages == "messages" else "prompt"
        return self.RENAMES.get(field, field)

    def __call__(self, exc: LmspError) -> None:
        exc.param = None if exc.param is None else self.name(exc.param)
        exc.message = re.sub(r"`([\w.\[\]]+)`", lambda m: f"`{self.name(m[1])}`", exc.message)


# -- answers --------------------------------------------------------------------------------------

def calls(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function calls of a response's output, as Ollama's `tool_calls` (arguments as an object)."""
    return [tool_call(item) for item in output if item["type"] == "function_call"]


def tool_call(item: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(item["arguments"])
    except ValueError:
        arguments = {}
    return {"function": {"name": item["name"], "arguments": arguments}}


def done_reason(final: dict[str, Any]) -> str:
    return "length" if final["status"] == "incomplete" else "stop"


def counts(usage: dict[str, Any] | None, started_ns: int, first_ns: int | None) -> dict[str, int]:
    """Ollama's counts and durations (nanoseconds). The prompt is read until the first token came
    (when it was seen: a stream), then the answer is written until now."""
    now = time.monotonic_ns()
    first = first_ns or started_ns
    usage = usage or {}
    return {"total_duration": now - started_ns, "load_duration": 0,
            "prompt_eval_count": usage.get("input_tokens", 0), "prompt_eval_duration": first - started_ns,
            "eval_count": usage.get("output_tokens", 0), "eval_duration": now - first}


def _file_name(model: dict[str, Any]) -> str:
    """The name of a local model's file, without the folders it is in ("" for a remote model)."""
    return PurePath(model.get("path") or "").name


def _quantization(model: dict[str, Any]) -> str:
    found = QUANT.findall(_file_name(model))
    return found[-1].upper() if found else ""


def details(model: dict[str, Any], header: dict[str, Any] | None) -> dict[str, Any]:
    family = model.get("architecture") or ""
    return {"parent_model": "", "format": model.get("format", "gguf"), "family": family,
            "families": [family] if family else None,
            "parameter_size": str((header or {}).get("general.size_label") or ""),
            "quantization_level": _quantization(model)}


def model_entry(model: dict[str, Any], header: dict[str, Any] | None) -> dict[str, Any]:
    """A model as `/api/tags` lists it."""
    name = ollama_name(model["id"])
    return {"name": name, "model": name, "modified_at": iso(model.get("created", 0)),
            "size": model.get("size_bytes") or 0, "digest": (model.get("digest") or "").removeprefix("sha256:"),
            "details": details(model, header)}


def running_entry(model: dict[str, Any], header: dict[str, Any] | None, kept: float | None,
                  idle_ttl: int) -> dict[str, Any]:
    """A loaded model as `/api/ps` lists it: kept `kept` seconds more (an app's `keep_alive`), else
    for the idle time set; until unloaded when neither says (inf, 0), written as a century from now.
    Whatever the time, the date is one `datetime` can hold (a NaN or a time past year 9999 is not)."""
    left = kept if kept is not None else idle_ttl or math.inf
    until = datetime.now(UTC) + timedelta(seconds=left if 0 <= left <= MAX_KEEP_ALIVE else FOREVER)
    size = (model.get("memory") or {}).get("total_bytes") or model.get("size_bytes") or 0
    # Its share on the GPU by layers, as apps divide size_vram by size for `ollama ps`'s 48%/52%
    # (the GPU's own count, compute buffers included, may be more than the estimate of `size`).
    return {**model_entry(model, header), "size": size, "size_vram": round(size * gpu_share(model.get("processor"))),
            "expires_at": until.isoformat().replace("+00:00", "Z"), "context_length": model.get("context_length")}


def show(model: dict[str, Any], header: dict[str, Any] | None, fills_in: bool) -> dict[str, Any]:
    """`/api/show`: what Open WebUI, Continue and Copilot read of a model. Its capabilities are
    what works through this API: `tools` for a local model (its template writes them, or the
    system message describes them: app/engine/request.py `Request.prompt`; a remote endpoint is
    sent none), `insert` (a `suffix`) where the model has fill-in-the-middle tokens, `vision`
    (`images`) where it was registered with a vision projector."""
    arch = model.get("architecture") or "llama"
    context = model.get("context_length") or 0
    # Ollama writes the blob's path after FROM; ours would show any page on this computer (this
    # surface can be tokenless) the user's name and folders, so the file is named without them.
    return {"license": str((header or {}).get("general.license") or ""),
            "modelfile": f"FROM {_file_name(model) or model['id']}\n", "parameters": f"num_ctx {context}",
            "template": str((header or {}).get("tokenizer.chat_template") or ""),
            "details": details(model, header), "modified_at": iso(model.get("created", 0)),
            "model_info": {"general.architecture": arch, f"{arch}.context_length": context,
                           "general.parameter_count": (header or {}).get("general.parameter_count")},
            "capabilities": ["completion", *(["tools"] if header is not None else []),
                             *(["insert"] if fills_in else []), *(["vision"] if model.get("projector") else []),
                             "embedding"]}
