"""A generation request: what a response asks the model for, in the one form it keeps from the
parser (app/core/requests.py) to the local engine or a remote endpoint.

It is stored with its response as JSON (`to_json`) and read back (`from_json`) by the runner,
which hands it to the engine as it is: to the local engine, which renders its prompt, or as the body of a
remote endpoint's request. What a response echoes of it (app/tasks/records.py) and a
conversation's earlier turns (app/core/conversation.py) are read from it too. The task's own
columns (model, `max_output_tokens`, `background`, `store`, metadata) are not in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NotRequired, TypedDict

# A JSON schema, as the client wrote it: any JSON object.
Schema = dict[str, Any]


class ChatMessage(TypedDict):
    role: str  # system | user | assistant
    content: str
    # The images the message shows the model, before its text, as checked `data:` URLs
    # (app/core/images.py); only a model with a vision projector is given any.
    images: NotRequired[list[str]]


class Format(TypedDict):
    """`text.format` as a response echoes it: `text`, `json_object`, or `json_schema` with the rest."""
    type: Literal["text", "json_object", "json_schema"]
    name: NotRequired[str]
    schema: NotRequired[Schema]
    strict: NotRequired[bool]
    description: NotRequired[str]


class Tool(TypedDict):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: Schema
    strict: bool


class NamedTool(TypedDict):
    type: Literal["function"]
    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedTool


class Constraint(TypedDict):
    """JSON the output must be: any object, or one matching `schema` under the grammar converted
    from it when the request was accepted (app/engine/constraints/grammar.py)."""
    type: Literal["json_object", "json_schema"]
    schema: NotRequired[Schema]
    gbnf: NotRequired[str]  # absent in requests stored before schemas were converted on arrival


TEXT: Format = {"type": "text"}
# Left out of the stored JSON at their defaults: earlier versions wrote them only when set, so
# every row, old or new, has one shape.
OMITTED_WHEN_UNSET = ("constraint", "call", "previous_response_id", "history", "raw", "suffix", "offer", "effort",
                      "reasoning", "tool_form")
# How a model calls a function it was offered (`tool_choice` auto) in Hermes' form, which Qwen's and
# Hermes' own templates teach their models, and the one described to a model whose template writes
# no functions (the others: app/engine/call_forms.py).
MARK, END = "<tool_call>", "</tool_call>"
# Where a thinking model's reasoning starts and ends (Qwen3's, DeepSeek-R1's, SmolLM3's templates).
THINK, THOUGHT = "<think>", "</think>"


@dataclass(frozen=True)
class Request:
    """What the model is asked for, as accepted: the chat, the sampling, the output's shape."""
    messages: list[ChatMessage]  # all the model sees: the instructions first, earlier turns, the input
    instructions: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    format: Format = field(default_factory=lambda: TEXT)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    constraint: Constraint | None = None
    call: bool = False  # a forced function call (app/tasks/calls.py): `constraint` is its schema
    previous_response_id: str | None = None  # the response this one continues (app/core/conversation.py)
    history: int = 0  # how many of `messages` came from it, once the chain is resolved
    # A prompt given as the model reads it (Ollama's `raw`): the one message's text, no template.
    raw: bool = False
    # Fill in the middle: the text after the gap, the one message's text the text before it. The
    # model's own FIM tokens frame them, without a template.
    suffix: str | None = None
    # Functions the model may call or not (`tool_choice` auto): the grammar of one call, which
    # binds the answer once it opens as a call (app/core/structured.py).
    offer: Constraint | None = None
    # The form the model's template writes calls in, from it when the request was accepted
    # (app/engine/call_forms.py `Form.name`): "" Hermes', which a model told of the functions in
    # its system message uses too.
    tool_form: str = ""
    # How much the model is to reason, where its template lets it choose: "" as it does by
    # default, "none" not at all, "low" / "medium" / "high" (`reasoning.effort`, Ollama's `think`).
    effort: str = ""
    # How the answer holds the model's reasoning, from its template when the request was accepted
    # (app/engine/template.py `ChatTemplate.reasoning`): "" it has none apart, "marked" between
    # THINK and THOUGHT if it opens with THINK, "open" up to THOUGHT (the prompt wrote THINK).
    reasoning: str = ""

    def to_json(self) -> str:
        """The text stored with the response (the limits count its bytes)."""
        stored = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps({k: v for k, v in stored.items() if v or k not in OMITTED_WHEN_UNSET})

    @classmethod
    def from_json(cls, text: str) -> Request:
        """A request as stored, by this version or an earlier one (which left out what it did not
        know yet: structured output, conversations). ValueError if the row is not one."""
        stored = json.loads(text)
        if not isinstance(stored, dict):
            raise ValueError("A stored request is a JSON object.")
        for key, value in stored.items():
            if key not in _SHAPES:
                raise ValueError(f"A stored request has no field {key!r}.")
            if not isinstance(value, _SHAPES[key]):
                raise ValueError(f"A stored request's {key!r} is not {_SHAPES[key]}.")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   and isinstance(m.get("images", []), list) and all(isinstance(i, str) for i in m.get("images", []))
                   for m in stored.get("messages", [])):
            raise ValueError("A stored request's messages each have a role and a content (and image URLs).")
        return cls(**{"messages": [], **stored})  # a row without messages: only ever one made by hand

    @property
    def images(self) -> int:
        """How many images the messages show."""
        return sum(len(m.get("images", ())) for m in self.messages)

    def seen(self) -> list[ChatMessage]:
        """Every message but the instructions: the earlier turns, then the input."""
        return self.messages[0 if self.instructions is None else 1:]

    def prompt(self, native: bool = False) -> list[ChatMessage]:
        """The messages the model is given. The functions it may call are described in the system
        message: for a forced call (the grammar decides the shape; this tells the model what the
        functions are for), and for an offer unless the template writes them itself (`native`:
        `ChatTemplate.form`)."""
        if self.call:
            choice = self.tool_choice
            named = choice["name"] if isinstance(choice, dict) else None
            tools = [t for t in self.tools if choice == "required" or t["name"] == named]
            note = (f"You can call these functions: {_listed(tools)}\nCall one now, answering with JSON "
                    '{"name": <function name>, "arguments": <its arguments>}.')
        elif self.offer is not None and not native:
            note = (f"You can call these functions: {_listed(self.tools)}\nTo call one, answer with only "
                    f'{MARK}{{"name": <function name>, "arguments": <its arguments>}}{END}. Otherwise answer '
                    "in text.")
        else:
            return self.messages
        messages = self.messages
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
        return [{"role": "system", "content": note}, *messages]


def payload(image: str) -> str:
    """The base64 of an image a message keeps (a `data:` URL)."""
    return image[image.index(",") + 1:]


def _described(tool: Tool) -> dict[str, Any]:
    return {k: v for k, v in (("name", tool["name"]), ("description", tool["description"]),
                              ("parameters", tool["parameters"])) if v is not None}


def _listed(tools: list[Tool]) -> str:
    return json.dumps([_described(t) for t in tools])


def chat_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The functions as chat templates read them (OpenAI's chat shape)."""
    return [{"type": "function", "function": _described(t)} for t in tools]


def thought(request: Request, text: str) -> tuple[str | None, str | None] | None:
    """The output's reasoning (None: it has none) and its answer (None: still reasoning), as
    `request.reasoning` says the model writes them, or None while it may still open with THINK."""
    body = text
    if request.reasoning == "marked":
        start = text.lstrip()
        if not start.startswith(THINK):
            return None if THINK.startswith(start) else (None, text)
        body = start[len(THINK):]
    elif request.reasoning != "open":
        return None, text
    end = body.find(THOUGHT)
    return (body, None) if end < 0 else (body[:end], body[end + len(THOUGHT):].lstrip())


# The JSON type of each stored field (a float field may have been written as an integer).
_SHAPES: dict[str, type | tuple[type, ...]] = {
    "messages": list, "instructions": (str, type(None)), "temperature": (int, float), "top_p": (int, float),
    "seed": (int, type(None)), "stop": list, "format": dict, "tools": list, "tool_choice": (str, dict),
    "constraint": (dict, type(None)), "call": bool, "previous_response_id": (str, type(None)), "history": int,
    "raw": bool, "suffix": (str, type(None)), "offer": (dict, type(None)), "effort": str, "reasoning": str,
    "tool_form": str,
}
