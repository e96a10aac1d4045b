"""The official `openai` SDK, unchanged but for `base_url` and `api_key`, against a real
headless service (LMSP: "existing clients work unchanged"). The SDK's own models validate
what we send; a failure here is a compatibility bug in the service."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai  # a test dependency (pyproject's `test` extra): never skipped, the check matters
import pytest

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.helpers import COUNT, pair_sync, wait_until

SCOPES = ["responses:read", "responses:write", "models:read", "tasks:read", "tasks:cancel"]
TERMINAL = {"completed", "incomplete", "failed", "cancelled"}


@pytest.fixture
def sdk(headless: Any) -> Iterator[Any]:
    headless.start()
    _, token = pair_sync(headless.url, headless.token, SCOPES, "openai-python")
    client = openai.OpenAI(base_url=f"{headless.url}/v1", api_key=token, max_retries=0, timeout=180)
    yield client
    client.close()


def wait_terminal(sdk: Any, response_id: str, timeout: float = 180) -> Any:
    return wait_until(lambda: (got := sdk.responses.retrieve(response_id)).status in TERMINAL and got,
                      timeout, 0.2, f"{response_id} to end")


def test_models_list(sdk):
    listed = list(sdk.models.list())
    ids = [m.id for m in listed]
    assert DEFAULT_MODEL_ID in ids
    default = next(m for m in listed if m.id == DEFAULT_MODEL_ID)
    assert default.object == "model" and default.owned_by == "local" and isinstance(default.created, int)
    assert sdk.models.retrieve(DEFAULT_MODEL_ID).id == DEFAULT_MODEL_ID


def test_responses_create_stream_and_chat(sdk):
    # Plain create.
    made = sdk.responses.create(model=DEFAULT_MODEL_ID, input="Say hi", max_output_tokens=16, temperature=0)
    assert made.id.startswith("resp_") and made.object == "response"
    assert made.status in ("completed", "incomplete")
    assert made.output_text.strip(), made
    assert made.output[0].type == "message" and made.output[0].content[0].type == "output_text"
    assert made.usage is not None and made.usage.output_tokens > 0
    assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens
    if made.status == "incomplete":
        assert made.incomplete_details.reason == "max_output_tokens"
    # Messages as input, with instructions.
    made2 = sdk.responses.create(model=DEFAULT_MODEL_ID, instructions="Answer briefly.", max_output_tokens=8,
                                 temperature=0, input=[{"role": "user", "content": "What is 2+2?"}])
    assert made2.output_text.strip()

    # Streaming: the SDK's typed events, deltas adding up to the final text.
    stream = sdk.responses.create(model=DEFAULT_MODEL_ID, input="Say hi", max_output_tokens=16, temperature=0,
                                  stream=True)
    types, deltas, final, stream_events = [], [], None, []
    for event in stream:
        stream_events.append(event)
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert types[0] == "response.created"
    assert "response.output_text.delta" in types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert final is not None and final.status in ("completed", "incomplete")
    assert "".join(deltas) == final.output_text and final.output_text.strip()
    # The stream's response is stored and can be fetched again.
    assert sdk.responses.retrieve(final.id).output_text == final.output_text

    # Every delta names the output message the final response carries.
    assert {e.item_id for e in stream_events if e.type == "response.output_text.delta"} == {final.output[0].id}

    # The SDK's higher-level stream helper (which rebuilds the response from the events, and
    # refuses a delta for an output item it was not told about) accepts our events too.
    with sdk.responses.stream(model=DEFAULT_MODEL_ID, input="Say hi", max_output_tokens=32,
                              temperature=0) as s:
        helper_events = list(s)
        texts = [e.delta for e in helper_events if e.type == "response.output_text.delta"]
        last = helper_events[-1]
        assert last.type in ("response.completed", "response.incomplete"), [e.type for e in helper_events]
        if last.type == "response.completed":
            got = s.get_final_response()
            assert got.output_text == last.response.output_text
    assert "".join(texts) == last.response.output_text and texts

    # Chat completions, plain and streamed.
    chat = sdk.chat.completions.create(model=DEFAULT_MODEL_ID, max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "Say hi"}])
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content.strip()
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens > 0
    chunks = list(sdk.chat.completions.create(model=DEFAULT_MODEL_ID, max_tokens=16, temperature=0, stream=True,
                                              messages=[{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Say hi"}]))
    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_background_retrieve_and_cancel(sdk):
    queued = sdk.responses.create(model=DEFAULT_MODEL_ID, input="Say hi", max_output_tokens=16, temperature=0,
                                  background=True)
    assert queued.background is True and queued.status in ("queued", "in_progress")
    done = wait_terminal(sdk, queued.id)
    assert done.status in ("completed", "incomplete") and done.output_text.strip()
    # Re-attaching to its event stream from a sequence number (how a client resumes a stream).
    replay = list(sdk.responses.retrieve(queued.id, stream=True, starting_after=0))
    assert replay[0].sequence_number == 1
    assert [e.sequence_number for e in replay] == list(range(1, len(replay) + 1))
    assert replay[-1].type == f"response.{done.status}"
    assert "".join(e.delta for e in replay if e.type == "response.output_text.delta") == done.output_text

    # Background and streamed at once: a 202 whose body is the event stream.
    events = list(sdk.responses.create(model=DEFAULT_MODEL_ID, input="Say hi", max_output_tokens=4,
                                       temperature=0, background=True, stream=True))
    assert events[0].type == "response.created" and events[0].response.background is True
    assert events[-1].type in ("response.completed", "response.incomplete")

    long = sdk.responses.create(model=DEFAULT_MODEL_ID, input=COUNT, max_output_tokens=2000, temperature=0,
                                background=True)
    wait_until(lambda: sdk.responses.retrieve(long.id).status != "queued", 180, 0.1,  # cancel it while it runs
               f"{long.id} to start")
    cancelled = sdk.responses.cancel(long.id)
    assert cancelled.id == long.id and cancelled.status in ("in_progress", "cancelled")
    final = wait_terminal(sdk, long.id, timeout=120)
    assert final.status == "cancelled"
    # Cancelling again: the SDK sees the service's 409 as a ConflictError.
    with pytest.raises(openai.ConflictError):
        sdk.responses.cancel(long.id)


def test_errors_reach_the_sdk_as_its_exceptions(sdk, headless):
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve("resp_doesnotexist")
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model=DEFAULT_MODEL_ID, input="hi", temperature=5)
    assert info.value.body["param"] == "temperature"
    # An input longer than the model's context, as OpenAI answers it: 400 before any output,
    # and on a chat stream an error the SDK raises rather than an empty answer.
    long = "word " * 5000
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model=DEFAULT_MODEL_ID, input=long)
    assert info.value.code == "context_length_exceeded" and info.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": long}])
    assert info.value.code == "context_length_exceeded" and info.value.body["param"] == "messages"
    with pytest.raises(openai.APIError, match="4096"):
        list(sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": long}],
                                         stream=True))
    bad = openai.OpenAI(base_url=f"{headless.url}/v1", api_key="lmsp_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()


def test_a_retried_stream_gets_the_same_stream(sdk):
    """A stream retried with its Idempotency-Key (after a dropped connection, say) is answered
    from the stored events: the same text, not an empty stream, and the model does not run again."""
    def responses_text(key: str) -> tuple[str, str]:
        events = list(sdk.responses.create(model=DEFAULT_MODEL_ID, input="Say hi", max_output_tokens=16,
                                           temperature=0, stream=True, extra_headers={"Idempotency-Key": key}))
        return "".join(e.delta for e in events if e.type == "response.output_text.delta"), events[-1].response.id

    def chat_text(key: str) -> tuple[str, Any]:
        chunks = list(sdk.chat.completions.create(
            model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": "Say hi"}], max_tokens=16, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_headers={"Idempotency-Key": key}))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

    text, response_id = responses_text("sdk-stream-1")
    assert text.strip() and responses_text("sdk-stream-1") == (text, response_id)
    chat, usage = chat_text("sdk-chat-1")
    assert chat.strip() and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert chat_text("sdk-chat-1") == (chat, usage)


def test_the_heartbeat_is_invisible_to_the_sdk():
    """LMSP §6: a heartbeat is a lone comment line; followed by a blank line it would become an
    empty event that the SDK fails to parse as JSON."""
    from openai._streaming import SSEDecoder

    from app.server.sse import frame

    first = {"type": "response.created", "sequence_number": 0}
    second = {"type": "response.queued", "sequence_number": 1}
    wire = frame(first) + b": keep-alive\n" + b": keep-alive\n" + frame(second)
    decoded = list(SSEDecoder().iter_bytes(iter([wire[i:i + 7] for i in range(0, len(wire), 7)])))
    assert [e.json() for e in decoded] == [first, second]
    assert [e.event for e in decoded] == ["response.created", "response.queued"]
