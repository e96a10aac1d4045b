"""Functions offered (`tool_choice` auto) to a model whose template writes calls in a form other
than Hermes' (app/engine/call_forms.py), on real llama.cpp through the official `openai` and
`ollama` packages: Llama 3.2's template is given the functions (in the first user message, under
`Environment: ipython`) and the model answers `{"name": ..., "parameters": {...}}`; Mistral's is
given them in `[AVAILABLE_TOOLS]` and answers `[TOOL_CALLS][...]` (Mistral-Nemo's) or
`[TOOL_CALLS]name[ARGS]{...}` (Mistral-Small 3.2's). The call comes back as each API's own call.

The templates are the models' own (tests/templates/, as llama.cpp's models/templates holds
them); the weights are the default model's. SmolLM2-135M makes a call when earlier turns of the
conversation show it calls in that form (greedy, so the same every time), as
tests/test_tools_offered.py: the weather in Rome, London and Berlin was asked, called for and
answered; now Paris is asked.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from app import paths
from app.core import structured
from app.engine import call_forms
from app.engine.constraints import grammar
from app.engine.parent import prompt
from app.engine.registry import gguf
from app.engine.request import Request
from app.engine.template import BREAK, SLOTS, ChatTemplate
from app.tasks import calls
from tests.conftest import Headless
from tests.helpers import pair_sync
from tests.test_templates import with_template
from tests.test_thinking import _merged
from tests.test_tools_offered import CHAT_TOOLS, PARIS, RESULT, TOOLS, responses_messages, sdk  # noqa: F401

pytestmark = pytest.mark.llama
TEMPLATES = Path(__file__).parent / "templates"
LLAMA = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text()
NEMO = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
SMALL = (TEMPLATES / "Mistral-Small-3.2-24B-Instruct-2506.jinja").read_text()
# Each form's call to get_weather, as the model writes it, %s its arguments.
FORMS = {"llama3": '<|python_tag|>{"name": "get_weather", "parameters": %s}',
         "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": %s}]',
         "mistral-args": "[TOOL_CALLS]get_weather[ARGS]%s"}
WRITTEN = {name: form % json.dumps({"city": "Paris"}) for name, form in FORMS.items()}

CITIES = ("Rome", "London", "Berlin")
# Answered in text under each template, the model's first token far from a call's (Mistral-Nemo's
# ends its answer at once: an empty message, still not a call).
THANKS = "Thank you!"


def responses_input(last: str) -> list[Any]:
    earlier = [[{"role": "user", "content": f"What is the weather in {city}?"},
                {"type": "function_call", "call_id": f"call_{city}", "name": "get_weather",
                 "arguments": json.dumps({"city": city})},
                {"type": "function_call_output", "call_id": f"call_{city}", "output": RESULT},
                {"role": "assistant", "content": f"It is sunny in {city}, 21 C."}] for city in CITIES]
    return [*sum(earlier, []), {"role": "user", "content": last}]


def chat_messages(last: str, ollama_shape: bool = False) -> list[Any]:
    """The same conversation as chat completions (or Ollama's chat, `ollama_shape`) writes it."""
    said: list[Any] = []
    for city in CITIES:
        call = {"name": "get_weather", "arguments": {"city": city} if ollama_shape else json.dumps({"city": city})}
        said += [{"role": "user", "content": f"What is the weather in {city}?"},
                 {"role": "assistant", "content": "", "tool_calls": [{"function": call}]} if ollama_shape else
                 {"role": "assistant", "tool_calls": [{"id": f"call_{city}", "type": "function", "function": call}]},
                 {"role": "tool", "content": RESULT, **({"tool_name": "get_weather"} if ollama_shape else
                                                        {"tool_call_id": f"call_{city}"})},
                 {"role": "assistant", "content": f"It is sunny in {city}, 21 C."}]
    return [*said, {"role": "user", "content": last}]


def offer(tools: list[Any] = TOOLS) -> Any:
    return structured.parse({"tools": tools}, grammar.convert_all).offer


def written(template: ChatTemplate, request: Request) -> str:
    """The prompt with each message's text in its slot, and the slots' texts marked «...»."""
    text, messages = template.prompt(request)
    return SLOTS.sub(lambda m: f"«{messages[int(m[1])]['content']}»", text).replace(BREAK, "")


def test_each_template_is_given_the_functions_and_shown_earlier_calls_in_its_own_form() -> None:
    with open(paths.default_model_file(), "rb") as f:
        own = gguf.read(f).chat_template
    assert own is not None and ChatTemplate(own).form is None  # SmolLM2's writes no functions
    for text, name, marks in ((LLAMA, "llama3", ["Environment: ipython", '"name": "get_weather"']),
                              (NEMO, "mistral", ['[AVAILABLE_TOOLS][{"type": "function"']),
                              (SMALL, "mistral-args", ['[AVAILABLE_TOOLS][{"type": "function"'])):
        template = ChatTemplate(text, "<s>", "</s>")
        assert template.form is not None and template.form.name == name
        request = Request(responses_messages(PARIS), tools=TOOLS, offer=offer(), tool_form=name)
        prompt_text = written(template, request)
        assert all(mark in prompt_text for mark in marks), prompt_text
        assert "Get the current weather in a city" in prompt_text and "You can call these functions" not in prompt_text
        # The earlier call, in the form's own words; its marks are the template's text (the
        # model's own tokens), not the message's.
        shown = {"llama3": '«{"name": "get_weather", "parameters": {"city": "Rome"}}»',
                 "mistral": '[TOOL_CALLS]«[{"name": "get_weather", "arguments": {"city": "Rome"}}]»',
                 "mistral-args": '[TOOL_CALLS]get_weather[ARGS]«{"city": "Rome"}»'}[name]
        assert shown in prompt_text and "<tool_call>" not in prompt_text, prompt_text
        # ... tokenized apart from the turn's opening before them, as the model writes them.
        assert name == "llama3" or BREAK + "[TOOL_CALLS]" in template.prompt(request)[0]
        # Not offered (`tool_choice: none`): no functions, the earlier call still in the form.
        plain = written(template, replace(request, offer=None, tool_form=""))
        assert "Get the current weather" not in plain and shown in plain


def test_each_form_reads_its_calls_and_a_resumed_answer_sends_what_an_uninterrupted_one_does() -> None:
    """The events are a function of the output text alone, in each form: cut anywhere, the events
    before the cut and after it are the uninterrupted ones, and the arguments stream as they are
    (held back only where a bracket may close the call); a text answer is held back only while it
    may still open as a call."""
    nested = {"city": "Paris", "days": [1, {"n": [2]}]}
    for name, form_text in FORMS.items():
        request = Request(responses_messages(PARIS), tools=TOOLS, offer=offer(), tool_form=name)
        for output in (form_text % json.dumps({"city": "Paris"}), form_text % json.dumps(nested), "It is sunny."):
            whole = calls.stream(request, "resp_x", "")
            expected = whole.feed(output) + whole.done("completed")
            for cut in range(len(output)):
                before = calls.stream(request, "resp_x", "").feed(output[:cut])
                resumed = calls.stream(request, "resp_x", output[:cut])
                assert _merged(before + resumed.feed(output[cut:]) + resumed.done("completed")) == _merged(expected)
            items, text = calls.output(request, "resp_x", output, "completed", True)
            if output.startswith("It"):
                assert [i["type"] for i in items] == ["message"] and text == output
                continue
            [item] = items
            assert (item["type"], item["name"], text) == ("function_call", "get_weather", ""), (name, items)
            assert json.loads(item["arguments"]) in ({"city": "Paris"}, nested), (name, item)
            streamed = "".join(data["delta"] for kind, data in expected if kind.endswith("arguments.delta"))
            assert streamed == item["arguments"], (name, streamed)
        form = call_forms.BY_NAME[name]
        call = WRITTEN[name]
        # A conversation carries the call on as a function_call item is kept, which the template
        # shows in its own form again.
        assert call_forms.recalled(calls.answer_of(request, call)) == ("get_weather", '{"city": "Paris"}')
        assert form.opens("It") is False and form.opens(call[:3]) is None and form.opens(call) is True
    llama = call_forms.LLAMA3
    assert llama.opens("{") is None and llama.opens('{"city": 1}') is False
    assert llama.opens("<|python_tag|>brave_search.call(query='x')") is False  # Llama 3.1's built-in tools: text


async def test_each_form_s_grammar_binds_a_call_on_llama_cpp(loaded: Any) -> None:
    """Each form's grammar, as llama-server is sent it: lazily triggered where the answer opens as
    a call (after a thinking model's reasoning too), and, for a call resumed mid-way, read from
    the call so far and completing one valid call in the form."""
    maker, server = loaded
    two = [*TOOLS, {"type": "function", "name": "get_time", "description": None, "strict": True,
                    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}]
    for tools in (TOOLS, two):
        for name, call in WRITTEN.items():
            form = call_forms.BY_NAME[name]
            request = Request(responses_messages(PARIS), tools=tools, offer=offer(tools), tool_form=name)
            lazy = prompt.body(request, [1], 40, "")
            assert lazy["grammar_lazy"] is True and lazy["preserved_tokens"] == list(form.preserved)
            thinking = prompt.body(replace(request, reasoning="open"), [1], 40, "I call it.")
            assert [t["value"] for t in thinking["grammar_triggers"]][1].startswith("</think>")
            assert "grammar" not in prompt.body(request, [1], 40, "It is")
            started = call[:call.index("Paris")]
            ids, out = await maker.ids(server, request, started)
            sent = prompt.body(request, ids + out, 40, started)
            assert sent["generation_prompt"] == started and "grammar_lazy" not in sent
            answer = await server.post("/completion", {**sent, "stream": False, "temperature": 0})
            [made], _ = calls.output(request, "resp_x", started + answer["content"], "completed", True)
            assert made["name"] == "get_weather" and set(json.loads(made["arguments"])) == {"city"}, (name, answer)


@pytest.mark.parametrize("model,template", [("llama3", LLAMA), ("mistral", NEMO), ("mistral-args", SMALL)])
def test_a_model_calls_in_its_own_form_through_every_api(sdk: openai.OpenAI, headless: Headless, tmp_path: Path,  # noqa: F811 (a fixture)
                                                         model: str, template: str) -> None:
    copy = tmp_path / f"{model}.gguf"
    with_template(paths.default_model_file(), copy, template)
    status, body = headless.request("POST", "/v1/models", {"path": str(copy), "id": model})
    assert status in (200, 201), body

    called = sdk.responses.create(model=model, input=responses_input(PARIS), tools=TOOLS, temperature=0)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather", called.output
    assert json.loads(call.arguments) == {"city": "Paris"} and called.output_text == ""
    plain = sdk.responses.create(model=model, input=responses_input(PARIS), temperature=0, max_output_tokens=20)
    assert called.usage.input_tokens > plain.usage.input_tokens + 50  # the functions, in the template's words
    # A forced call is bound to one from its first token, whatever the template's form.
    forced = sdk.responses.create(model=model, input=responses_input(THANKS), tools=TOOLS, tool_choice="required",
                                  temperature=0)
    [made_call] = forced.output
    assert made_call.type == "function_call" and set(json.loads(made_call.arguments)) == {"city"}, forced.output
    answered = sdk.responses.create(model=model, input=responses_input(THANKS), tools=TOOLS, temperature=0,
                                    max_output_tokens=40)
    [message] = answered.output
    assert message.type == "message" and "get_weather" not in answered.output_text, answered.output
    # Continued after its result, the conversation shows the model its call in its own form.
    more = sdk.responses.create(model=model, previous_response_id=called.id, tools=TOOLS, temperature=0,
                                max_output_tokens=20, input=[{"type": "function_call_output",
                                                              "call_id": call.call_id, "output": RESULT}])
    assert more.error is None and more.usage.input_tokens > called.usage.input_tokens
    seen = list(sdk.responses.create(model=model, input=responses_input(PARIS), tools=TOOLS, temperature=0,
                                     stream=True))
    types = [e.type for e in seen]
    assert "response.output_text.delta" not in types and seen[-1].response.output[0].type == "function_call", types
    assert "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta") == call.arguments

    made = sdk.chat.completions.create(model=model, messages=chat_messages(PARIS), tools=CHAT_TOOLS, temperature=0)
    [chat_call] = made.choices[0].message.tool_calls or []
    assert made.choices[0].finish_reason == "tool_calls" and made.choices[0].message.content is None
    assert chat_call.function.name == "get_weather" and json.loads(chat_call.function.arguments) == {"city": "Paris"}
    chunks = list(sdk.chat.completions.create(model=model, messages=chat_messages(PARIS), tools=CHAT_TOOLS,
                                              temperature=0, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert json.loads("".join(d[0].function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = sdk.chat.completions.create(model=model, messages=chat_messages(THANKS), tools=CHAT_TOOLS, temperature=0,
                                      max_tokens=40)
    assert text.choices[0].finish_reason in ("stop", "length") and not text.choices[0].message.tool_calls

    assert headless.request("PATCH", "/v1/settings", {"ollama_api": "token"})[0] == 200
    _, token = pair_sync(headless.url, headless.token, ["responses:write", "models:read"], "ollama app")
    client = ollama.Client(host=headless.url, headers={"Authorization": f"Bearer {token}"}, timeout=180)
    history = chat_messages(PARIS, ollama_shape=True)
    asked = client.chat(model=model, messages=history, tools=CHAT_TOOLS, options={"temperature": 0})
    [ollama_call] = asked.message.tool_calls or []
    assert ollama_call.function.name == "get_weather" and ollama_call.function.arguments == {"city": "Paris"}
    streamed = list(client.chat(model=model, messages=history, tools=CHAT_TOOLS, stream=True,
                                options={"temperature": 0}))
    assert [c.function.arguments for p in streamed for c in (p.message.tool_calls or [])] == [{"city": "Paris"}]
    assert "".join(p.message.content or "" for p in streamed) == ""
