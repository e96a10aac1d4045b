"""A thinking model's reasoning, apart from its answer, on real llama.cpp through the official
`openai` and `ollama` packages: a Responses `reasoning` item (streamed as
`response.reasoning_text.delta`), chat `reasoning_content`, Ollama `thinking`; `reasoning.effort`
"none" and Ollama's `think: false` reach the template, which then leaves the reasoning out.

The model is the default one's weights under a template of DeepSeek-R1's kind (the prompt opens the
reasoning with <think>; Qwen3's `enable_thinking` false closes it at once). SmolLM2-135M reasons
and answers in that form when an earlier turn shows it one (greedy, so the same every time).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from app import paths
from app.engine.request import Request
from app.tasks import calls
from tests.conftest import Headless
from tests.helpers import pair_sync
from tests.test_templates import with_template
from tests.test_terminal import output as printed_by

pytestmark = pytest.mark.llama
THINKING = """{% for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
SHOWN = [{"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\n2 + 2 = 4."}]
ASKED = [*SHOWN, {"role": "user", "content": "What is 3+5?"}]
REASONING, ANSWER = "The user asks for 3+5. That is 8.", "3 + 5 = 8."


@pytest.fixture
def sdk(headless: Headless, tmp_path: Path) -> Iterator[openai.OpenAI]:
    headless.start()
    copy = tmp_path / "thinker.gguf"
    with_template(paths.default_model_file(), copy, THINKING)
    status, body = headless.request("POST", "/v1/models", {"path": str(copy), "id": "thinker"})
    assert status in (200, 201), body
    _, token = pair_sync(headless.url, headless.token, ["responses:write", "responses:read", "models:read"], "thinking")
    client = openai.OpenAI(base_url=f"{headless.url}/v1", api_key=token, max_retries=0, timeout=180)
    yield client
    client.close()


def test_the_reasoning_is_an_item_of_its_own_and_never_in_the_answer(sdk: openai.OpenAI) -> None:
    made = sdk.responses.create(model="thinker", input=ASKED, temperature=0, max_output_tokens=60)
    thought, said = made.output
    assert thought.type == "reasoning" and [part.text for part in thought.content or []] == [REASONING], made.output
    assert said.type == "message" and made.output_text == ANSWER
    # Streamed: the reasoning item (index 0) with its deltas, then the message (index 1) with its own.
    seen = list(sdk.responses.create(model="thinker", input=ASKED, temperature=0, max_output_tokens=60, stream=True))
    assert "".join(e.delta for e in seen if e.type == "response.reasoning_text.delta") == REASONING
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == ANSWER
    added = [(e.output_index, e.item.type) for e in seen if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")], added
    types = [e.type for e in seen]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert [i.model_dump(exclude={"id"}) for i in seen[-1].response.output] == \
        [i.model_dump(exclude={"id"}) for i in made.output]
    # A conversation carries the answer on, not the reasoning (as thinking models' templates do).
    more = sdk.responses.create(model="thinker", previous_response_id=made.id, input="And 1+1?", temperature=0,
                                max_output_tokens=30)
    earlier = [item.content[0].text for item in sdk.responses.input_items.list(more.id, order="asc").data]
    assert earlier[-2] == ANSWER, earlier


def test_no_reasoning_when_the_effort_is_none(sdk: openai.OpenAI) -> None:
    made = sdk.responses.create(model="thinker", input=ASKED, temperature=0, max_output_tokens=30,
                                reasoning={"effort": "none"})
    assert [item.type for item in made.output] == ["message"] and made.output_text.strip(), made.output
    assert "<think>" not in made.output_text and "</think>" not in made.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="thinker", input=ASKED, reasoning={"effort": "lots"})
    assert refused.value.body["param"] == "reasoning.effort"


def test_chat_and_ollama_apps_get_the_reasoning_in_their_own_fields(sdk: openai.OpenAI, headless: Headless) -> None:
    made = sdk.chat.completions.create(model="thinker", messages=ASKED, temperature=0, max_tokens=60)
    message = made.choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == REASONING, message
    chunks = list(sdk.chat.completions.create(model="thinker", messages=ASKED, temperature=0, max_tokens=60,
                                              stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER

    assert headless.request("PATCH", "/v1/settings", {"ollama_api": "token"})[0] == 200
    _, token = pair_sync(headless.url, headless.token, ["responses:write", "models:read"], "ollama app")
    client = ollama.Client(host=headless.url, headers={"Authorization": f"Bearer {token}"}, timeout=180)
    answered = client.chat(model="thinker", messages=ASKED, think=True, options={"temperature": 0, "num_predict": 60})
    assert answered.message.thinking == REASONING and answered.message.content == ANSWER, answered.message
    streamed = list(client.chat(model="thinker", messages=ASKED, think=True, stream=True,
                                options={"temperature": 0, "num_predict": 60}))
    assert "".join(p.message.thinking or "" for p in streamed) == REASONING
    assert "".join(p.message.content or "" for p in streamed) == ANSWER
    plain = client.chat(model="thinker", messages=ASKED, think=False, options={"temperature": 0, "num_predict": 30})
    assert plain.message.thinking is None and plain.message.content.strip(), plain.message


def test_a_resumed_answer_sends_what_an_uninterrupted_one_does() -> None:
    """The events are a function of the output text alone: cut anywhere (a crash, a slot given
    back), the events stored before the cut and those sent after it are the uninterrupted ones."""
    text = f"{REASONING}\n</think>\n\n{ANSWER}"
    for reasoning, output in (("open", text), ("marked", f"<think>\n{text}"), ("marked", ANSWER)):
        request = Request([{"role": "user", "content": "x"}], reasoning=reasoning)
        whole = calls.stream(request, "resp_x", "")
        expected = whole.feed(output) + whole.done("completed")
        for cut in range(len(output)):
            before = calls.stream(request, "resp_x", "").feed(output[:cut])
            resumed = calls.stream(request, "resp_x", output[:cut])
            after = resumed.feed(output[cut:]) + resumed.done("completed")
            assert _merged(before + after) == _merged(expected), (reasoning, cut)
        if reasoning == "open":  # cut off before it wrote a word: its item still opens, then ends
            ended = calls.stream(request, "resp_x", "").done("incomplete")
            assert [kind for kind, _ in ended] == ["response.output_item.added", "response.reasoning_text.done",
                                                   "response.output_item.done"]
        items, answer = calls.output(request, "resp_x", output, "completed", True)
        assert answer == ANSWER and [i["type"] for i in items] == (["message"] if output == ANSWER
                                                                   else ["reasoning", "message"])


def _merged(events: list[calls.Event]) -> list[Any]:
    """The events with each run of deltas of one kind joined (a cut splits a delta in two)."""
    merged: list[Any] = []
    for kind, data in events:
        if kind.endswith(".delta") and merged and merged[-1][0] == kind:
            merged[-1] = (kind, {**data, "delta": merged[-1][1]["delta"] + data["delta"]})
        else:
            merged.append((kind, json.loads(json.dumps(data))))
    return merged


def test_a_thinking_model_reasons_then_calls_a_function_it_is_offered(sdk: openai.OpenAI) -> None:
    """The call after the reasoning is bound by the offer's grammar too (its trigger follows
    </think>): a reasoning item, then the function call, with valid arguments."""
    weather = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    shown = [{"role": "user", "content": "What is the weather in Rome?"},
             {"role": "assistant", "content": "<think>\nThe user asks for the weather in Rome. I call get_weather."
                                              "\n</think>"},
             {"type": "function_call", "call_id": "call_rome", "name": "get_weather",
              "arguments": json.dumps({"city": "Rome"})},
             {"type": "function_call_output", "call_id": "call_rome", "output": "sunny, 21 C"},
             {"role": "user", "content": "What is the weather in Paris?"}]
    made = sdk.responses.create(model="thinker", input=shown, tools=[weather], temperature=0, max_output_tokens=80)
    thought, call = made.output
    assert thought.type == "reasoning" and "Paris" in (thought.content or [])[0].text, made.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}, made.output
    assert made.output_text == ""


def test_the_terminal_prints_the_reasoning_as_ollama_run_does(sdk: openai.OpenAI, headless: Headless) -> None:
    printed = printed_by(headless.data_dir, "run", "--max-tokens", "60", "thinker", "What is 3+5?")
    task = headless.get("/v1/tasks?limit=1")[1]["data"][0]
    made = headless.get(f"/v1/responses/{task['response_id']}")[1]
    thought = made["output"][0]["content"][0]["text"]
    assert printed.startswith(f"Thinking...\n{thought}"), printed
    if made["output_text"]:
        assert f"\n...done thinking.\n\n{made['output_text']}" in printed, printed
