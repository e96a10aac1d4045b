"""Chat templates that refuse a conversation (Mistral-Instruct's, Gemma's and Llama 2's call
`raise_exception` when roles do not alternate; Gemma 1/2's on any system message): the request is
refused alone, with a 400 in the template's own words, never the engine and the tasks beside it.
Real llama.cpp, with the default model copied under such a template (only the template changes)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from app import paths
from app.engine.registry.gguf import MAX_TEMPLATE_BYTES
from tests.helpers import COUNT, bearer, expect_error, pair, wait_status
from tests.test_api import task
from tests.test_parallel import exact, generating_together, start

pytestmark = pytest.mark.llama
ALTERNATE = "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."
# Mistral-Instruct's check, around SmolLM2's own ChatML turns.
MISTRAL = ("{%- if messages[0]['role'] == 'system' %}{%- set loop_messages = messages[1:] %}"
           "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
           "{%- for message in loop_messages %}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{- raise_exception('" + ALTERNATE + "') }}{%- endif %}{%- endfor %}"
           "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")
# Gemma 1/2's: no system turn at all.
GEMMA = ("{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
         + MISTRAL)
# The same as MISTRAL, past the size the check reads from the file: only the engine renders it.
HUGE = MISTRAL + "{# " + "x" * MAX_TEMPLATE_BYTES + " #}"
TWO_USERS = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
# Long tasks: SmolLM2's own system message (its template's default) keeps it counting.
LONG = {"max_output_tokens": 96, "temperature": 0, "background": True,
        "instructions": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def with_template(source: Path, target: Path, template: str | None, numbers: dict[str, int] | None = None) -> None:
    """A copy of the GGUF file `source` whose `tokenizer.chat_template` is `template` (None: its
    own), with the unsigned `numbers` added to its header (the tensors byte for byte; the header
    is that of the default model, small and GGUF version 3)."""
    data = source.read_bytes()
    _, _, tensors, count = struct.unpack_from("<4sIQQ", data)
    at, kept, align = 24, [], 32
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(p: int, kind: int) -> int:
        if kind in sizes:
            return p + sizes[kind]
        if kind == 8:
            return p + 8 + struct.unpack_from("<Q", data, p)[0]
        inner, n = struct.unpack_from("<IQ", data, p)
        p += 12
        if inner in sizes:
            return p + sizes[inner] * n
        for _ in range(n):
            p = skip(p, inner)
        return p

    for _ in range(count):
        n = struct.unpack_from("<Q", data, at)[0]
        key = data[at + 8:at + 8 + n].decode()
        kind = struct.unpack_from("<I", data, at + 8 + n)[0]
        end = skip(at + 12 + n, kind)
        if key == "general.alignment":
            align = struct.unpack_from("<I", data, at + 12 + n)[0]
        if key != "tokenizer.chat_template" or template is None:
            kept.append(data[at:end])
        at = end
    infos_at = at
    for _ in range(tensors):
        n = struct.unpack_from("<Q", data, at)[0]
        dims = struct.unpack_from("<I", data, at + 8 + n)[0]
        at += 8 + n + 4 + 8 * dims + 4 + 8
    if template is not None:
        kept.append(_string("tokenizer.chat_template") + struct.pack("<I", 8) + _string(template))
    kept += [_string(key) + struct.pack("<II", 4, value) for key, value in (numbers or {}).items()]
    head = b"GGUF" + struct.pack("<IQQ", 3, tensors, len(kept)) + b"".join(kept) + data[infos_at:at]
    target.write_bytes(head + bytes(-len(head) % align) + data[at + -at % align:])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("templates")
    made = {}
    for name, template in (("mistral", MISTRAL), ("gemma", GEMMA), ("huge", HUGE)):
        made[name] = folder / f"{name}.gguf"
        with_template(paths.default_model_file(), made[name], template)
    return made


async def register(api: Any, files: dict[str, Path], name: str) -> str:
    resp = await api.post("/v1/models", json={"path": str(files[name]), "id": name})
    assert resp.status in (200, 201), await resp.text()
    return name


async def ollama_chat(api: Any, body: dict[str, Any]) -> Any:
    """Ollama's /api/chat, as an Ollama app with a token asks it."""
    assert (await api.patch("/v1/settings", json={"ollama_api": "token"})).status == 200
    return await api.post("/api/chat", json={**body, "stream": False})


async def tasks_of(api: Any) -> list[dict[str, Any]]:
    resp = await api.get("/v1/tasks")
    assert resp.status == 200, await resp.text()
    return list((await resp.json())["data"])


async def test_a_conversation_the_template_refuses_is_a_400_in_its_words_before_any_engine(
        api: Any, service: Any, files: dict[str, Path]) -> None:
    await register(api, files, "mistral")
    await register(api, files, "gemma")
    resp = await api.post("/v1/responses", json={"model": "mistral", "input": TWO_USERS, "max_output_tokens": 3})
    error = await expect_error(resp, 400, "template_error", "input")
    assert error["message"] == f"This model's chat template refuses this conversation: {ALTERNATE}", error
    resp = await api.post("/v1/responses", json={"model": "gemma", "input": "hi", "instructions": "Be brief.",
                                                 "max_output_tokens": 3, "background": True})
    assert (await expect_error(resp, 400, "template_error", "input"))["message"].endswith("System role not supported")
    # Ollama apps are told the same, in Ollama's shape.
    resp = await ollama_chat(api, {"model": "mistral", "messages": TWO_USERS})
    assert resp.status == 400 and ALTERNATE in (await resp.json())["error"], await resp.text()
    # Refused as the request was read: no task, no failure stored, no engine started.
    assert await tasks_of(api) == [] and service.pool.loaded_paths() == set()
    # A conversation that continues an earlier one is checked with its earlier turns.
    resp = await api.post("/v1/responses", json={"model": "mistral", "input": "Say hi.", "max_output_tokens": 3})
    assert resp.status == 200, await resp.text()
    answered = await resp.json()
    resp = await api.post("/v1/responses", json={"model": "mistral", "previous_response_id": answered["id"],
                                                 "input": [{"role": "assistant", "content": "hello"}]})
    await expect_error(resp, 400, "template_error", "input")
    assert len(await tasks_of(api)) == 1


@pytest.mark.parametrize("model", ["mistral", "huge"])
async def test_tasks_beside_a_refused_request_carry_on(api: Any, service: Any, files: dict[str, Path],
                                                       model: str) -> None:
    """Another app's three tasks run on the model (`parallel` 4) when the refused request comes.
    `huge`'s template is past what the check reads: the engine child refuses that request alone."""
    assert service.settings["parallel"] == 4
    await register(api, files, model)
    _, token = await pair(api, ["responses:write", "responses:read", "tasks:read"], "Other App")
    other = bearer(token)
    ids = [await start(api, {**LONG, "model": model, "input": f"{COUNT} ({n})"}, other) for n in range(3)]
    await generating_together(api, ids)
    (engine,) = service.pool.holding(str(files[model]))
    pid = engine.pid
    resp = await api.post("/v1/responses", json={"model": model, "input": TWO_USERS, "max_output_tokens": 3})
    error = await expect_error(resp, 400, "template_error", "input")
    assert ALTERNATE in error["message"], error
    assert [(await task(api, i))["status"] for i in ids] == ["running"] * 3  # refused while they ran
    for task_id in ids:
        done = await exact(api, task_id)
        assert done["status"] == "completed" and done["attempt"] == 1, done
        assert done["response"]["usage"]["output_tokens"] == 96, done["response"]["usage"]
    assert service.pool.holding(str(files[model])) == [engine] and engine.pid == pid  # the same child all along
    refused = [t for t in await tasks_of(api) if t["id"] not in ids]
    assert [(t["status"], t["error"]["code"]) for t in refused] == ([] if model == "mistral" else
                                                                     [("failed", "template_error")])


@pytest.mark.parametrize("model", ["mistral", "huge"])
async def test_a_refused_request_is_never_run_again(api: Any, service: Any, files: dict[str, Path],
                                                    model: str) -> None:
    await register(api, files, model)
    body = {"model": model, "input": TWO_USERS, "max_output_tokens": 3, "background": True, "on_restart": "retry"}
    resp = await api.post("/v1/responses", json=body)
    if model == "mistral":
        await expect_error(resp, 400, "template_error", "input")
        assert await tasks_of(api) == [] and service.pool.loaded_paths() == set()
        return
    assert resp.status == 202, await resp.text()
    task_id = (await resp.json())["task"]["id"]
    failed = await wait_status(api, task_id, timeout=120)
    assert failed["status"] == "failed" and failed["error"]["code"] == "template_error", failed
    assert failed["attempt"] == 1 and ALTERNATE in failed["error"]["message"], failed
    (engine,) = service.pool.holding(str(files[model]))
    pid = engine.pid
    resp = await api.post("/v1/responses", json={"model": model, "input": "Say hi.", "max_output_tokens": 3})
    assert resp.status == 200, await resp.text()
    assert service.pool.holding(str(files[model])) == [engine] and engine.pid == pid  # the engine never died


async def test_two_tool_results_in_a_row_are_one_turn(api: Any, files: dict[str, Path]) -> None:
    """An assistant turn with two calls, then both results: one turn each, as alternation wants."""
    await register(api, files, "mistral")
    calls = [{"type": "function_call", "call_id": f"call_{city}", "name": "weather",
              "arguments": json.dumps({"city": city})} for city in ("Paris", "Rome")]
    results = [{"type": "function_call_output", "call_id": f"call_{city}", "output": degrees}
               for city, degrees in (("Paris", "12 C"), ("Rome", "18 C"))]
    asked = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    resp = await api.post("/v1/responses", json={"model": "mistral", "max_output_tokens": 5,
                                                 "input": [*asked, *calls, *results]})
    assert resp.status == 200, await resp.text()
    resp = await api.get(f"/v1/responses/{(await resp.json())['id']}/input_items?order=asc")
    said = [(item["role"], item["content"][0]["text"]) for item in (await resp.json())["data"]]
    assert [role for role, _ in said] == ["user", "assistant", "user"], said
    assert said[2][1] == "The function weather returned: 12 C\n\nThe function weather returned: 18 C", said
    # Ollama's tool messages, as Open WebUI sends them.
    messages = [*asked, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "weather", "arguments": {"city": city}}} for city in ("Paris", "Rome")]},
        {"role": "tool", "tool_name": "weather", "content": "12 C"},
        {"role": "tool", "tool_name": "weather", "content": "18 C"}]
    resp = await ollama_chat(api, {"model": "mistral", "messages": messages, "options": {"num_predict": 5}})
    assert resp.status == 200, await resp.text()
