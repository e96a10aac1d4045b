"""Ollama's API (LMSP §15) with the official `ollama` Python package over real llama.cpp: where the
model's output matters (a chat's text, JSON that follows a schema, embeddings' numbers)."""

from __future__ import annotations

import json
from typing import Any

import ollama
import pytest

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.conftest import Headless
from tests.helpers import pair_sync

pytestmark = pytest.mark.llama
NAME = f"{DEFAULT_MODEL_ID}:latest"


@pytest.fixture
def client(headless: Headless) -> Any:
    headless.start()
    assert headless.request("PATCH", "/v1/settings", {"ollama_api": "token"})[0] == 200
    _, token = pair_sync(headless.url, headless.token, ["models:read", "responses:write"], "ollama-python")
    return ollama.Client(host=headless.url, headers={"Authorization": f"Bearer {token}"}, timeout=180)


def test_chat_streamed_and_not(client: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    said = client.chat(model=NAME, messages=messages, stream=False, options={"temperature": 0, "num_predict": 24})
    assert said.message.content.strip() and said.eval_count > 0 and said.eval_duration > 0
    parts = list(client.chat(model=NAME, messages=messages, stream=True, options={"temperature": 0, "num_predict": 24}))
    assert "".join(p.message.content for p in parts) == said.message.content  # temperature 0: the same text
    assert parts[-1].done and parts[-1].done_reason == said.done_reason


def test_generate_with_a_format_schema(client: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    made = client.generate(model=NAME, prompt="Describe Paris as JSON.", format=schema, stream=False,
                           options={"temperature": 0, "num_predict": 60})
    answer = json.loads(made.response)
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
    plain = client.generate(model=NAME, prompt="Describe Paris as JSON.", format="json", stream=False,
                            options={"temperature": 0, "num_predict": 60})
    assert isinstance(json.loads(plain.response), dict)
    with pytest.raises(ollama.ResponseError) as refused:  # fail-closed: never silently unconstrained
        client.generate(model=NAME, prompt="hi", format={"type": "object", "patternProperties": {"^a": {}}},
                        stream=False)
    assert refused.value.status_code == 400 and "cannot be enforced" in refused.value.error


def test_embed_and_the_older_embeddings(client: Any) -> None:
    made = client.embed(model=NAME, input=["The cat sat.", "A dog ran."])
    assert made.model == NAME and len(made.embeddings) == 2 and len(made.embeddings[0]) == 576
    assert made.prompt_eval_count > 0
    assert sum(x * x for x in made.embeddings[0]) == pytest.approx(1.0, abs=1e-3)  # normalised, as Ollama's
    older = client.embeddings(model=DEFAULT_MODEL_ID, prompt="The cat sat.")
    assert list(older.embedding) == pytest.approx(made.embeddings[0], abs=1e-4)
