"""A response's one output item and its stream events, each a function of the output text alone,
so a resumed task (whose earlier events are stored) knows where its stream stands: a message
(`TextStream`), a forced function call (`CallStream`), or, where functions are offered
(`tool_choice` auto), whichever the answer turns out to be (`Offered`): a call if it opens as one
in the form the request was accepted for (app/engine/call_forms.py: Hermes' `<tool_call>`,
Llama 3's, Mistral's `[TOOL_CALLS]`).

A forced call is one JSON object `{"name": "<function>", "arguments": {...}}`, name first (the
grammar of app/core/structured.py `call_schema` makes it so); an offered one is the form's.
Everything after the head (up to the function's name and the arguments' key) is the arguments,
but for what closes the call (`Form.arguments`): so the arguments can stream as they are decoded,
holding back only a trailing `}` that may turn out to be the object's brace, or the start of a
closing mark.
"""

from __future__ import annotations

from typing import Any

from app.engine import call_forms
from app.engine.call_forms import HERMES, Form, held
from app.engine.request import THOUGHT, Request, thought

Event = tuple[str, dict[str, Any]]


def message_id(response_id: str) -> str:
    """The id of a response's one output message: `msg_` + the random part of `resp_...`."""
    return "msg_" + response_id[5:]


def item_ids(response_id: str) -> tuple[str, str]:
    """The item id and call id of a response's one call, from the random part of `resp_...`."""
    return "fc_" + response_id[5:], "call_" + response_id[5:]


def output(request: Request, response_id: str, text: str, status: str, done: bool) -> tuple[list[Any], str]:
    """The response's output items and `output_text`, from the output's text: the model's
    reasoning, if any, then its answer: a function call (forced, or offered and made), its
    item once the model has named the function, or a message."""
    read = thought(request, text)  # None: it may still open with THINK, at the end it did not
    reasoning, answer = read if read is not None else (None, text if done else None)
    items: list[Any] = []
    if reasoning is not None:
        items.append(reasoning_item(response_id, _shown(reasoning, answer is not None or done),
                                    status if answer is None else "completed"))
    if answer is None:
        return items, ""
    form = call_forms.of(request)
    if request.call or (request.offer is not None and form.opens(answer) is True):
        call = item(response_id, answer, status, form)
        return items + ([call] if call else []), ""
    if answer or done:
        items.append({"type": "message", "id": message_id(response_id), "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": answer, "annotations": []}]})
    return items, answer


def answer_of(request: Request, text: str) -> str:
    """The model's answer in its output text, without its reasoning (what a conversation carries
    on). A call offered in another form is carried on in Hermes', as a `function_call` input
    item is (app/core/structured.py `item_message`): the template shows it in its own form, its
    marks as the template's text (app/engine/template.py `ChatTemplate.prompt`)."""
    read = thought(request, text)
    answer = text if read is None or read[1] is None else read[1]
    form = call_forms.of(request)
    found = form.named(answer) if request.offer is not None and form is not HERMES else None
    return answer if found is None else HERMES.said(found[0], form.arguments(answer, found[1]))[1]


def item(response_id: str, text: str, status: str, form: Form = HERMES) -> dict[str, Any] | None:
    """The `function_call` output item of a call written in `form`, or None while the name is not
    written yet."""
    found = form.named(text)
    if found is None:
        return None
    ident, call_id = item_ids(response_id)
    return {"type": "function_call", "id": ident, "call_id": call_id, "name": found[0],
            "arguments": form.arguments(text, found[1]), "status": status}


def message_opened(item_id: str, index: int = 0) -> list[Event]:
    """The output message and its text part, opened before the first delta, as OpenAI's stream
    does: the openai SDK's `responses.stream()` helper refuses deltas for an item it was not given."""
    opened = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    return [("response.output_item.added", {"output_index": index, "item": opened}),
            ("response.content_part.added", {"item_id": item_id, "output_index": index, "content_index": 0,
                                             "part": part})]


class TextStream:
    """A message's text, as it grows (its item is opened before: `message_opened`), the
    response's output `index`."""

    def __init__(self, item_id: str, text: str = "", index: int = 0) -> None:
        self.item_id, self.text, self.index = item_id, text, index

    def feed(self, text: str) -> list[Event]:
        self.text += text
        return [("response.output_text.delta", {"delta": text, "output_index": self.index, "content_index": 0,
                                                "item_id": self.item_id})] if text else []

    def done(self, status: str) -> list[Event]:
        return [("response.output_text.done", {"text": self.text, "output_index": self.index, "content_index": 0,
                                               "item_id": self.item_id})]

    def again(self) -> TextStream:
        """The stream of an output that starts again from nothing."""
        return TextStream(self.item_id, "", self.index)


class CallStream:
    """Turns a call's output text (in `form`), as it grows, into the events OpenAI streams for one call."""

    def __init__(self, response_id: str, text: str = "", index: int = 0, form: Form = HERMES) -> None:
        self.response_id, self.text, self.index, self.form = response_id, text, index, form
        found = form.named(text)
        self.sent = None if found is None else len(form.arguments(text, found[1]))  # argument chars streamed

    def feed(self, text: str) -> list[Event]:
        self.text += text
        found = self.form.named(self.text)
        if found is None:
            return []
        ident = item_ids(self.response_id)[0]
        events: list[Event] = []
        if self.sent is None:
            added = item(self.response_id, self.text[:found[1]], "in_progress", self.form)
            events.append(("response.output_item.added", {"output_index": self.index, "item": added}))
            self.sent = 0
        args = self.form.arguments(self.text, found[1])
        if len(args) > self.sent:
            events.append(("response.function_call_arguments.delta",
                           {"item_id": ident, "output_index": self.index, "delta": args[self.sent:]}))
            self.sent = len(args)
        return events

    def done(self, status: str) -> list[Event]:
        final = item(self.response_id, self.text, status, self.form)
        if final is None:
            return []
        return [("response.function_call_arguments.done", {"item_id": final["id"], "output_index": self.index,
                                                            "name": final["name"], "arguments": final["arguments"]}),
                ("response.output_item.done", {"output_index": self.index, "item": final})]

    def again(self) -> CallStream:
        return CallStream(self.response_id, "", self.index, self.form)


class Offered:
    """The answer where functions are offered: nothing is sent while it may still open as a call
    (in `form`), then a call's events, or the message's (its item opened first)."""

    def __init__(self, response_id: str, text: str = "", index: int = 0, form: Form = HERMES) -> None:
        """`text`: the output so far, its events sent (or, while it may be either, held back)."""
        self.response_id, self.index, self.form = response_id, index, form
        self.held = ""  # the text while it may be either
        self.inner: TextStream | CallStream | None = None
        opened = form.opens(text)
        if opened is None:
            self.held = text
        else:
            self.inner = CallStream(response_id, text, index, form) if opened else \
                TextStream(message_id(response_id), text, index)

    @property
    def text(self) -> str:
        return self.held if self.inner is None else self.inner.text

    def _decide(self, text: str, last: bool = False) -> list[Event]:
        """The events of the text held and `text`, once the answer is known to be a call or not
        (at the `last`: text)."""
        self.held += text
        opened = self.form.opens(self.held)
        if opened is None and not last:
            return []
        kept, self.held = self.held, ""
        if opened:
            self.inner = CallStream(self.response_id, "", self.index, self.form)
            return self.inner.feed(kept)
        self.inner = TextStream(message_id(self.response_id), "", self.index)
        return [*message_opened(self.inner.item_id, self.index), *self.inner.feed(kept)]

    def feed(self, text: str) -> list[Event]:
        return self._decide(text) if self.inner is None else self.inner.feed(text)

    def done(self, status: str) -> list[Event]:
        opening = self._decide("", last=True) if self.inner is None else []
        assert self.inner is not None
        return [*opening, *self.inner.done(status)]

    def again(self) -> Offered:
        return Offered(self.response_id, "", self.index, self.form)


def reasoning_id(response_id: str) -> str:
    """The id of a response's reasoning item: `rs_` + the random part of `resp_...`."""
    return "rs_" + response_id[5:]


def reasoning_item(response_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The `reasoning` output item: its text once it is whole (None: not yet)."""
    return {"type": "reasoning", "id": reasoning_id(response_id), "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}], "status": status}


def _shown(reasoning: str, whole: bool) -> str:
    """The reasoning as it is shown: without the whitespace around it, nor the start of THOUGHT
    while it may be that (`whole`: it ended)."""
    return reasoning.strip() if whole else reasoning[:len(reasoning) - held(reasoning, THOUGHT)].strip()


class Reasoned:
    """The model's reasoning (`Request.reasoning`), then its answer: a `reasoning` item first,
    streamed as it is decoded, then the answer's item after it (a message, or a call offered);
    an answer that does not open with THINK has the answer's item alone."""

    def __init__(self, request: Request, response_id: str, text: str = "") -> None:
        """`text`: the output so far, its events sent."""
        self.request, self.response_id = request, response_id
        self.text = ""
        self.opened = False  # whether its reasoning item was sent
        self.said = 0  # reasoning characters sent
        self.answer: Stream | None = None
        self.fed = 0  # answer characters given to `answer`
        self._read(text)  # the state its events left (they were sent)

    def _read(self, text: str, last: bool = False) -> list[Event]:
        self.text += text
        read = thought(self.request, self.text)
        if read is None and last:  # it ended while it could still have opened with THINK
            read = None, self.text
        if read is None:
            return []
        reasoning, answer = read
        events: list[Event] = []
        if reasoning is not None and (reasoning or answer is not None):  # its item opens with its first text
            events += self._open()
            shown = _shown(reasoning, answer is not None)
            if len(shown) > self.said:
                events.append(("response.reasoning_text.delta", {"item_id": reasoning_id(self.response_id),
                                                                  "output_index": 0, "content_index": 0,
                                                                  "delta": shown[self.said:]}))
                self.said = len(shown)
        if answer is not None:
            if self.answer is None:
                if reasoning is not None:
                    events += self._thought("completed")
                self.answer, opening = answer_stream(self.request, self.response_id, int(reasoning is not None))
                events += opening
            events += self.answer.feed(answer[self.fed:])
            self.fed = len(answer)
        return events

    def _open(self) -> list[Event]:
        """The reasoning item's first event, unless it was sent."""
        if self.opened:
            return []
        self.opened = True
        return [("response.output_item.added", {"output_index": 0, "item": reasoning_item(
            self.response_id, None, "in_progress")})]

    def _thought(self, status: str) -> list[Event]:
        """The reasoning item's last events, with its whole text."""
        read = thought(self.request, self.text)
        item = reasoning_item(self.response_id, _shown((read and read[0]) or "", True), status)
        return [("response.reasoning_text.done", {"item_id": item["id"], "output_index": 0, "content_index": 0,
                                                  "text": item["content"][0]["text"]}),
                ("response.output_item.done", {"output_index": 0, "item": item})]

    def feed(self, text: str) -> list[Event]:
        return self._read(text)

    def done(self, status: str) -> list[Event]:
        events = self._read("", last=True)
        if self.answer is None:  # it ended while reasoning (cut off), perhaps before a word of it
            return [*events, *self._open(), *self._thought(status)]
        return [*events, *self.answer.done(status)]

    def again(self) -> Reasoned:
        return Reasoned(self.request, self.response_id)


Stream = TextStream | CallStream | Offered | Reasoned


def answer_stream(request: Request, response_id: str, index: int) -> tuple[TextStream | Offered, list[Event]]:
    """The answer's stream at output `index`, and the events that open it (a message's item, where
    it cannot be a call)."""
    if request.offer is not None:
        return Offered(response_id, "", index, call_forms.of(request)), []
    ident = message_id(response_id)
    return TextStream(ident, "", index), message_opened(ident, index)


def stream(request: Request, response_id: str, text: str) -> Stream:
    """The events of a response's output from `text`, what it has so far, on."""
    if request.call:
        return CallStream(response_id, text)
    if request.reasoning:
        return Reasoned(request, response_id, text)
    if request.offer is not None:
        return Offered(response_id, text, 0, call_forms.of(request))
    return TextStream(message_id(response_id), text)

