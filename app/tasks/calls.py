"""A forced function call: how its output becomes a `function_call` item and its stream
events (how the model is asked for it: app/engine/request.py `Request.prompt`).

The grammar (app/core/structured.py `call_schema`) makes the model write exactly one JSON
object `{"name": "<function>", "arguments": {...}}`, name first. Everything after the head
(up to the name's closing quote and `"arguments":`) is the arguments, but for the object's
own closing brace: so the arguments can stream as they are decoded, holding back only a
trailing `}` that may turn out to be that brace. What is sent is a function of the text
alone, so a resumed task (whose earlier events are stored) knows where its stream stands.
"""

from __future__ import annotations

import json
import re
from typing import Any

HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
Event = tuple[str, dict[str, Any]]


def head(text: str) -> tuple[str, int] | None:
    """The function's name and where its arguments start, once the model has written them."""
    match = HEAD.match(text)
    return (json.loads(match[1]), match.end()) if match else None


def arguments(text: str, start: int) -> str:
    """The arguments as far as they can be told apart from the closing brace."""
    rest = text[start:].rstrip()
    return rest[:-1].rstrip() if rest.endswith("}") else rest


def item_ids(response_id: str) -> tuple[str, str]:
    """The item id and call id of a response's one call, from the random part of `resp_...`."""
    return "fc_" + response_id[5:], "call_" + response_id[5:]


def item(response_id: str, text: str, status: str) -> dict[str, Any] | None:
    """The `function_call` output item, or None while the name is not written yet."""
    found = head(text)
    if found is None:
        return None
    ident, call_id = item_ids(response_id)
    return {"type": "function_call", "id": ident, "call_id": call_id, "name": found[0],
            "arguments": arguments(text, found[1]), "status": status}


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

