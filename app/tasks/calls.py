"""A response's one output item and its stream events, each a function of the output text alone,
so a resumed task (whose earlier events are stored) knows where its stream stands: a message
(`TextStream`), a forced function call (`CallStream`), or, where functions are offered
(`tool_choice` auto), whichever the answer turns out to be (`Offered`): a call if it opens with
MARK (how the model is asked for either: app/engine/request.py `Request.prompt`).

A call is one JSON object `{"name": "<function>", "arguments": {...}}`, name first (the grammar
of app/core/structured.py `call_schema` makes it so), between MARK and END when it was offered.
Everything after the head (up to the name's closing quote and `"arguments":`) is the arguments,
but for the object's own closing brace and END: so the arguments can stream as they are decoded,
holding back only a trailing `}` that may turn out to be that brace, or the start of END.
"""

from __future__ import annotations

import json
import re
from typing import Any

from app.engine.request import END, MARK, Request, opens

HEAD = re.compile(rf'\s*(?:{re.escape(MARK)}\s*)?\{{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
Event = tuple[str, dict[str, Any]]


def head(text: str) -> tuple[str, int] | None:
    """The function's name and where its arguments start, once the model has written them."""
    match = HEAD.match(text)
    return (json.loads(match[1]), match.end()) if match else None


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def arguments(text: str, start: int) -> str:
    """The arguments as far as they can be told apart from the closing brace and END."""
    rest = text[start:]
    end = rest.find(END)
    rest = (rest[:end] if end >= 0 else rest[:len(rest) - _held(rest, END)]).rstrip()
    return rest[:-1].rstrip() if rest.endswith("}") else rest


def message_id(response_id: str) -> str:
    """The id of a response's one output message: `msg_` + the random part of `resp_...`."""
    return "msg_" + response_id[5:]


def item_ids(response_id: str) -> tuple[str, str]:
    """The item id and call id of a response's one call, from the random part of `resp_...`."""
    return "fc_" + response_id[5:], "call_" + response_id[5:]


def is_call(request: Request, text: str) -> bool:
    """Whether the output is a function call: forced, or offered and made."""
    return request.call or (request.offer is not None and opens(text) is True)


def item(response_id: str, text: str, status: str) -> dict[str, Any] | None:
    """The `function_call` output item, or None while the name is not written yet."""
    found = head(text)
    if found is None:
        return None
    ident, call_id = item_ids(response_id)
    return {"type": "function_call", "id": ident, "call_id": call_id, "name": found[0],
            "arguments": arguments(text, found[1]), "status": status}


def message_opened(item_id: str) -> list[Event]:
    """The output message and its text part, opened before the first delta, as OpenAI's stream
    does: the openai SDK's `responses.stream()` helper refuses deltas for an item it was not given."""
    opened = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    return [("response.output_item.added", {"output_index": 0, "item": opened}),
            ("response.content_part.added", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                             "part": part})]


class TextStream:
    """A message's text, as it grows (its item is opened before: `message_opened`)."""

    def __init__(self, item_id: str, text: str = "") -> None:
        self.item_id = item_id
        self.text = text

    def feed(self, text: str) -> list[Event]:
        self.text += text
        return [("response.output_text.delta", {"delta": text, "output_index": 0, "content_index": 0,
                                                "item_id": self.item_id})] if text else []

    def done(self, status: str) -> list[Event]:
        return [("response.output_text.done", {"text": self.text, "output_index": 0, "content_index": 0,
                                               "item_id": self.item_id})]

    def again(self) -> TextStream:
        """The stream of an output that starts again from nothing."""
        return TextStream(self.item_id)


class CallStream:
    """Turns a call's output text, as it grows, into the events OpenAI streams for one call."""

    def __init__(self, response_id: str, text: str = "") -> None:
        self.response_id = response_id
        self.text = text
        found = head(text)
        self.sent = None if found is None else len(arguments(text, found[1]))  # argument chars streamed

    def feed(self, text: str) -> list[Event]:
        self.text += text
        found = head(self.text)
        if found is None:
            return []
        ident = item_ids(self.response_id)[0]
        events: list[Event] = []
        if self.sent is None:
            added = item(self.response_id, self.text[:found[1]], "in_progress")
            events.append(("response.output_item.added", {"output_index": 0, "item": added}))
            self.sent = 0
        args = arguments(self.text, found[1])
        if len(args) > self.sent:
            events.append(("response.function_call_arguments.delta",
                           {"item_id": ident, "output_index": 0, "delta": args[self.sent:]}))
            self.sent = len(args)
        return events

    def done(self, status: str) -> list[Event]:
        final = item(self.response_id, self.text, status)
        if final is None:
            return []
        return [("response.function_call_arguments.done", {"item_id": final["id"], "output_index": 0,
                                                            "name": final["name"], "arguments": final["arguments"]}),
                ("response.output_item.done", {"output_index": 0, "item": final})]

    def again(self) -> CallStream:
        return CallStream(self.response_id)


class Offered:
    """The answer where functions are offered: nothing is sent while it may still open with MARK,
    then a call's events, or the message's (its item opened first)."""

    def __init__(self, response_id: str, text: str = "") -> None:
        """`text`: the output so far, its events sent (or, while it may be either, held back)."""
        self.response_id = response_id
        self.held = ""  # the text while it may be either
        self.inner: TextStream | CallStream | None = None
        opened = opens(text)
        if opened is None:
            self.held = text
        else:
            self.inner = CallStream(response_id, text) if opened else TextStream(message_id(response_id), text)

    @property
    def text(self) -> str:
        return self.held if self.inner is None else self.inner.text

    def _decide(self, text: str, last: bool = False) -> list[Event]:
        """The events of the text held and `text`, once the answer is known to be a call or not
        (at the `last`: text)."""
        self.held += text
        opened = opens(self.held)
        if opened is None and not last:
            return []
        held, self.held = self.held, ""
        if opened:
            self.inner = CallStream(self.response_id)
            return self.inner.feed(held)
        self.inner = TextStream(message_id(self.response_id))
        return [*message_opened(self.inner.item_id), *self.inner.feed(held)]

    def feed(self, text: str) -> list[Event]:
        return self._decide(text) if self.inner is None else self.inner.feed(text)

    def done(self, status: str) -> list[Event]:
        opening = self._decide("", last=True) if self.inner is None else []
        assert self.inner is not None
        return [*opening, *self.inner.done(status)]

    def again(self) -> Offered:
        return Offered(self.response_id)


Stream = TextStream | CallStream | Offered


def stream(request: Request, response_id: str, text: str) -> Stream:
    """The events of a response's output from `text`, what it has so far, on."""
    if request.call:
        return CallStream(response_id, text)
    if request.offer is not None:
        return Offered(response_id, text)
    return TextStream(message_id(response_id), text)
