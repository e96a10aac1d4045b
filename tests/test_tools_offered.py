"""Functions offered to the model (`tool_choice` auto, the default of every agent framework and
the only mode Ollama apps have), on real llama.cpp, through the official `openai` and `ollama`
packages: the model calls one when it chooses to, in Hermes' form, and the call comes back as
each API's own call; when it answers in text, the text comes back. Its template writes the
functions where it knows how (Qwen's, Hermes'), the system message describes them elsewhere.

SmolLM2-135M makes a call when an earlier turn of the conversation shows it one (greedy, so the
same every time): the weather in Rome was asked, called for and answered; now Paris is asked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from app import paths
from app.core import requests, structured
from app.engine import call_forms
from app.engine.constraints import grammar
from app.engine.parent import prompt
from app.engine.registry import gguf
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.engine.request import Request
from app.engine.template import SLOTS, ChatTemplate
from tests.conftest import Headless
from tests.helpers import pair_sync
from tests.test_templates import with_template

pytestmark = pytest.mark.llama
MODEL = DEFAULT_MODEL_ID
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
                     "parameters": WEATHER}]
CHAT_TOOLS: list[Any] = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
ROME = {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}
RESULT = "sunny, 21 C"
SAID = "It is sunny in Rome, 21 C."
PARIS = "What is the weather in Paris?"
HELLO = "Hi! How are you?"
# A Hermes-style template, as Qwen2.5's writes functions: in the system turn, calls between marks.
HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{% for message in messages %}{% if message['role'] != 'system' %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture
def sdk(headless: Headless) -> Iterator[openai.OpenAI]:
    headless.start()
    _, token = pair_sync(headless.url, headless.token, ["responses:write", "responses:read", "models:read"], "agent")
    client = openai.OpenAI(base_url=f"{headless.url}/v1", api_key=token, max_retries=0, timeout=180)
    yield client
    client.close()


def responses_input(last: str) -> list[Any]:
    return [{"role": "user", "content": "What is the weather in Rome?"},
            {"type": "function_call", "call_id": "call_rome", **ROME},
            {"type": "function_call_output", "call_id": "call_rome", "output": RESULT},
            {"role": "assistant", "content": SAID}, {"role": "user", "content": last}]


def chat_messages(last: str) -> list[Any]:
    return [{"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "tool_calls": [{"id": "call_rome", "type": "function", "function": ROME}]},
            {"role": "tool", "tool_call_id": "call_rome", "content": RESULT},
            {"role": "assistant", "content": SAID}, {"role": "user", "content": last}]


def test_an_agent_gets_a_call_when_the_model_makes_one_and_text_when_it_answers(sdk: openai.OpenAI) -> None:
    called = sdk.responses.create(model=MODEL, input=responses_input(PARIS), tools=TOOLS, temperature=0)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather", called.output
    assert json.loads(call.arguments) == {"city": "Paris"} and called.output_text == ""
    answered = sdk.responses.create(model=MODEL, input=responses_input(HELLO), tools=TOOLS, temperature=0)
    [message] = answered.output
    assert message.type == "message" and answered.output_text.strip(), answered.output
    assert "<tool_call>" not in answered.output_text and "get_weather" not in answered.output_text
    # With `tool_choice: none` the functions are not offered: the same question is answered in text.
    refused = sdk.responses.create(model=MODEL, input=responses_input(PARIS), tools=TOOLS, tool_choice="none",
                                   temperature=0, max_output_tokens=30)
    assert refused.output[0].type == "message", refused.output


def test_a_call_streams_as_openai_s_events_and_replays_the_same(sdk: openai.OpenAI, headless: Headless) -> None:
    seen = list(sdk.responses.create(model=MODEL, input=responses_input(PARIS), tools=TOOLS, temperature=0,
                                     stream=True))
    final = seen[-1].response
    [call] = final.output
    types = [e.type for e in seen]
    assert "response.output_text.delta" not in types and "response.content_part.added" not in types, types
    assert types.index("response.output_item.added") < types.index("response.function_call_arguments.done") \
        < types.index("response.output_item.done") < types.index("response.completed")
    assert "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta") == call.arguments
    replayed = sdk.responses.retrieve(final.id, stream=True, starting_after=0)
    assert [e.type for e in replayed] == types[1:]
    # A text answer streams as a message, its item opened before its first delta.
    text = list(sdk.responses.create(model=MODEL, input=responses_input(HELLO), tools=TOOLS, temperature=0,
                                     stream=True))
    kinds = [e.type for e in text]
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") \
        < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in text if e.type == "response.output_text.delta") == text[-1].response.output_text


def test_chat_completions_and_ollama_apps_get_their_own_tool_calls(sdk: openai.OpenAI, headless: Headless) -> None:
    made = sdk.chat.completions.create(model=MODEL, messages=chat_messages(PARIS), tools=CHAT_TOOLS, temperature=0)
    choice = made.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=chat_messages(PARIS), tools=CHAT_TOOLS,
                                              temperature=0, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather"
    assert json.loads("".join(d[0].function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    text = sdk.chat.completions.create(model=MODEL, messages=chat_messages(HELLO), tools=CHAT_TOOLS, temperature=0)
    assert text.choices[0].finish_reason == "stop" and text.choices[0].message.content

    assert headless.request("PATCH", "/v1/settings", {"ollama_api": "token"})[0] == 200
    _, token = pair_sync(headless.url, headless.token, ["responses:write", "models:read"], "ollama app")
    client = ollama.Client(host=headless.url, headers={"Authorization": f"Bearer {token}"}, timeout=180)
    assert "tools" in client.show(f"{MODEL}:latest").capabilities
    history = [{"role": "user", "content": "What is the weather in Rome?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
               {"role": "tool", "content": RESULT, "tool_name": "get_weather"},
               {"role": "assistant", "content": SAID}]
    asked = client.chat(model=f"{MODEL}:latest", messages=[*history, {"role": "user", "content": PARIS}],
                        tools=CHAT_TOOLS, options={"temperature": 0})
    [made_call] = asked.message.tool_calls or []
    assert made_call.function.name == "get_weather" and made_call.function.arguments == {"city": "Paris"}
    streamed = [part for part in client.chat(model=f"{MODEL}:latest", tools=CHAT_TOOLS, stream=True,
                                             messages=[*history, {"role": "user", "content": PARIS}],
                                             options={"temperature": 0})]
    assert [c.function.arguments for p in streamed for c in (p.message.tool_calls or [])] == [{"city": "Paris"}]
    assert "".join(p.message.content or "" for p in streamed) == ""


def test_a_template_that_writes_functions_is_given_them(sdk: openai.OpenAI, headless: Headless,
                                                         tmp_path: Path) -> None:
    with open(paths.default_model_file(), "rb") as f:
        own = gguf.read(f).chat_template
    assert own is not None and ChatTemplate(own).form is None  # SmolLM2's: the system message describes them
    hermes = ChatTemplate(HERMES)
    assert hermes.form is call_forms.HERMES
    request = Request([{"role": "user", "content": PARIS}], tools=TOOLS, offer={"type": "json_object"})
    prompt, messages = hermes.prompt(request)
    written = SLOTS.sub(lambda m: messages[int(m[1])]["content"], prompt)
    assert '"name": "get_weather"' in written and "Get the current weather in a city" in written
    assert messages == request.messages  # no description added: the template's own words say it
    described, told = ChatTemplate(own).prompt(request)
    assert "You can call these functions" in SLOTS.sub(lambda m: told[int(m[1])]["content"], described)

    copy = tmp_path / "hermes.gguf"
    with_template(paths.default_model_file(), copy, HERMES)
    status, body = headless.request("POST", "/v1/models", {"path": str(copy), "id": "hermes"})
    assert status in (200, 201), body
    called = sdk.responses.create(model="hermes", input=responses_input(PARIS), tools=TOOLS, temperature=0)
    [call] = called.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}, called.output
    plain = sdk.responses.create(model="hermes", input=responses_input(PARIS), temperature=0, max_output_tokens=40)
    assert called.usage.input_tokens > plain.usage.input_tokens + 100  # the template's tool section


async def test_a_call_cut_off_by_a_crash_carries_on_under_its_grammar(loaded: Any) -> None:
    """A task resumed mid-call (after a crash, or given its slot back) sends the call so far: the
    grammar first reads it, and the rest still makes one valid call. Once the output is plain
    text, no grammar binds it."""
    maker, server = loaded
    request = Request(responses_messages(PARIS), tools=TOOLS, offer=offer())
    started = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    ids, out = await maker.ids(server, request, started)
    sent = prompt.body(request, ids + out, 40, started)
    assert sent["grammar_type"] == "tool_calls" and sent["generation_prompt"] == started and "grammar_lazy" not in sent
    answer = await server.post("/completion", {**sent, "stream": False, "temperature": 0})
    whole = started + answer["content"]
    assert whole.rstrip().endswith("</tool_call>"), whole
    arguments = json.loads(whole[whole.index('"arguments": ') + 13:whole.rindex("}")])
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str), whole
    assert "grammar" not in prompt.body(request, ids, 40, "It is")
    assert prompt.body(request, ids, 40, "")["grammar_lazy"] is True
    # A thinking model's call comes after its reasoning: the grammar is triggered there too, and a
    # call begun after it is read from where the answer starts.
    thinking = replace(request, reasoning="open")
    triggers = [t["value"] for t in prompt.body(thinking, ids, 40, "I call it.")["grammar_triggers"]]
    assert triggers == [r"^\s*(<tool_call>)", r"</think>\s*(<tool_call>)"], triggers
    resumed = prompt.body(thinking, ids, 40, f"I call it.\n</think>\n\n{started}")
    assert resumed["generation_prompt"] == started and "grammar_lazy" not in resumed


def responses_messages(last: str) -> list[Any]:
    """`responses_input(last)` as the request stores it."""
    return requests.parse({"input": responses_input(last)}, grammar.convert_all).request.messages


def offer() -> Any:
    return structured.parse({"tools": TOOLS}, grammar.convert_all).offer
