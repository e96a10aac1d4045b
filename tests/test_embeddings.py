"""`POST /v1/embeddings` (LMSP §12): real vectors from the default model, through the official SDK
and the raw API."""

from __future__ import annotations

import math
from typing import Any

import openai

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.conftest import Headless
from tests.helpers import bearer, expect_error, pair, pair_sync, raw

SENTENCES = ["The cat sleeps on the sofa.", "Paris is the capital of France.", "I like green apples."]


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))  # both L2-normalised


def test_the_sdk_gets_normalised_vectors_in_order_as_base64_and_float(headless: Headless) -> None:
    headless.start()
    _, token = pair_sync(headless.url, headless.token, ["responses:write"], "search-app")
    sdk = openai.OpenAI(base_url=f"{headless.url}/v1", api_key=token, max_retries=0, timeout=120)
    packed = sdk.embeddings.create(model=DEFAULT_MODEL_ID, input=SENTENCES)  # the SDK asks for base64
    plain = sdk.embeddings.create(model=DEFAULT_MODEL_ID, input=SENTENCES, encoding_format="float")
    assert [d.index for d in packed.data] == [0, 1, 2] and packed.model == DEFAULT_MODEL_ID
    assert packed.usage.prompt_tokens == packed.usage.total_tokens > len(SENTENCES)
    for a, b in zip(packed.data, plain.data):
        assert len(a.embedding) == len(b.embedding) == 576  # SmolLM2-135M's width
        assert abs(norm(a.embedding) - 1) < 1e-4
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6  # the same numbers
    # A batch comes back in order: each vector is the one that sentence gets alone.
    for i, sentence in enumerate(SENTENCES):
        alone = sdk.embeddings.create(model=DEFAULT_MODEL_ID, input=sentence, encoding_format="float").data[0]
        assert cosine(alone.embedding, plain.data[i].embedding) > 0.999, i
    cut = sdk.embeddings.create(model=DEFAULT_MODEL_ID, input="Hello there.", dimensions=64).data[0].embedding
    assert len(cut) == 64 and abs(norm(cut) - 1) < 1e-4
    sdk.close()


PAIRS = [  # (sentence, a paraphrase, something unrelated)
    ("The cat is sleeping on the sofa.", "A cat naps on the couch.", "The stock market fell sharply today."),
    ("How do I bake bread at home?", "What is a simple recipe for homemade bread?", "The train leaves at noon."),
    ("It is raining heavily outside.", "There is a lot of rain falling today.", "She plays the violin well."),
    ("My laptop will not turn on.", "The computer does not start anymore.", "We went swimming in the lake."),
    ("He scored a goal in the football match.", "The soccer player kicked the ball into the net.",
     "Please pass the salt."),
]


async def embed(api: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return await api.post("/v1/embeddings", json=body, headers=headers or {})


async def test_similar_sentences_score_higher_than_unrelated_ones(api: Any) -> None:
    resp = await embed(api, {"input": [s for triple in PAIRS for s in triple]})
    assert resp.status == 200, await resp.text()
    vectors = [d["embedding"] for d in (await resp.json())["data"]]
    for k, (sentence, _, _) in enumerate(PAIRS):
        base, similar, unrelated = vectors[3 * k:3 * k + 3]
        assert cosine(base, similar) > cosine(base, unrelated), sentence


async def test_bad_input_is_refused_naming_it(api: Any) -> None:
    too_long = "word " * 6000  # more tokens than the 4096 of the context
    await expect_error(await embed(api, {"input": ["fine", too_long]}), 400, "context_length_exceeded", "input[1]")
    await expect_error(await embed(api, {"input": ""}), 400, "invalid_request", "input")
    await expect_error(await embed(api, {"input": []}), 400, "invalid_request", "input")
    await expect_error(await embed(api, {"input": ["a", ""]}), 400, "invalid_request", "input[1]")
    await expect_error(await embed(api, {"input": [1, 2]}), 400, "invalid_request", "input[0]")
    await expect_error(await embed(api, {"input": "a", "encoding_format": "hex"}), 400, "invalid_request",
                       "encoding_format")
    await expect_error(await embed(api, {"input": "a", "dimensions": 100000}), 400, "invalid_request", "dimensions")
    await expect_error(await embed(api, {"input": "a", "dimensions": 0}), 400, "invalid_request", "dimensions")
    await expect_error(await embed(api, {"input": "a", "model": "nope"}), 404, "model_not_found", "model")
    await expect_error(await embed(api, {"input": "a", "stream": True}), 400, "invalid_request", "stream")


async def test_embeddings_need_responses_write(api: Any) -> None:
    _, reader = await pair(api, ["responses:read", "models:read"], "Reader")
    resp, text = await raw(api, "POST", "/v1/embeddings", headers=bearer(reader), json={"input": "hi"})
    assert resp.status == 403 and '"insufficient_scope"' in text, text
    resp, text = await raw(api, "POST", "/v1/embeddings", json={"input": "hi"})
    assert resp.status == 401, text
