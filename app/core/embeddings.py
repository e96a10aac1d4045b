"""`POST /v1/embeddings` (LMSP §12): vectors for texts, from any registered model.

Synchronous, not a durable task: nothing is stored, and the caller waits for the answer, as
with OpenAI. A llama-server of its own computes it (the event loop only awaits), beside the
engine's generations (llama.cpp serves embeddings only in a server started for them).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from app.engine.parent.pool import EnginePool
from app.engine.registry import models
from app.engine.runs import EngineError
from app.errors import InvalidRequest, LmspError
from app.events import EventBus
from app.store.store import Store

KNOWN = {"model", "input", "encoding_format", "dimensions", "user"}
MAX_INPUTS = 2048  # as OpenAI


def parse(body: Any) -> tuple[str, list[str], str, int | None]:
    """(model id, texts, encoding format, dimensions), or a 400 naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for key in body:
        if key not in KNOWN:
            raise InvalidRequest(f"Unknown parameter {key!r}.", param=key)
    model = body.get("model") or models.DEFAULT_MODEL_ID
    if not isinstance(model, str):
        raise InvalidRequest("`model` must be a model id.", param="model")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not 1 <= len(texts) <= MAX_INPUTS:
        raise InvalidRequest(f"`input` must be a string or a list of 1 to {MAX_INPUTS} strings.", param="input")
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise InvalidRequest("Each input must be a non-empty string.",
                                 param="input" if isinstance(body["input"], str) else f"input[{i}]")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidRequest("`encoding_format` must be float or base64.", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise InvalidRequest("`dimensions` must be a positive integer.", param="dimensions")
    return model, texts, encoding, dimensions


class Embeddings:
    def __init__(self, store: Store, bus: EventBus, pool: EnginePool) -> None:
        self.store = store
        self.bus = bus
        self.pool = pool

    async def embed(self, body: Any, app: str) -> dict[str, Any]:
        """The vectors of the texts `body` asks for, with the model it names (`app` used it: `Client.app`)."""
        model_id, texts, encoding, dimensions = parse(body)
        try:
            model = await self.store.read(models.usable, model_id)
        except LmspError as exc:
            if exc.status == 404:
                raise LmspError("model_not_found", f"The model {model_id!r} does not exist.", param="model",
                                status=404) from exc
            raise
        if model["format"] == "remote":
            raise InvalidRequest(f"{model_id!r} is a remote model; embeddings are computed by local models only.",
                                 param="model", code="model_not_supported")
        try:
            done = await self.pool.for_embedding(model["path"]).embed(models.registered(model), texts, dimensions)
        except EngineError as exc:
            if exc.param is not None:  # the request's fault: an input too long, too many dimensions
                raise InvalidRequest(exc.message, param=exc.param, code=exc.code) from exc
            status = {"model_load_failed": 422, "model_changed": 409, "engine_crashed": 503}.get(exc.code, 500)
            raise LmspError(exc.code, exc.message, status=status) from exc
        self.pool.used(model["path"], app)
        if done["fresh"]:
            self.bus.publish([{"type": "models.changed"}])
        # 2,048 vectors make 1.2 million numbers: made on a thread, not on the loop.
        return await asyncio.to_thread(_answer, model_id, done, len(texts), encoding)


def _answer(model_id: str, done: dict[str, Any], count: int, encoding: str) -> dict[str, Any]:
    import numpy as np  # llama.cpp's dependency, loaded where it is used: the first answer's thread

    vectors = np.frombuffer(done["vectors"], dtype="<f4").reshape(count, done["dims"])
    return {"object": "list", "model": model_id,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(row, encoding)}
                     for i, row in enumerate(vectors)],
            "usage": {"prompt_tokens": done["tokens"], "total_tokens": done["tokens"]}}


def _encoded(row: Any, encoding: str) -> Any:
    """base64 of the little-endian float32s (what the openai SDK asks for and decodes), or the
    numbers themselves: a numpy row, which the HTTP surface writes at float32's own precision."""
    return base64.b64encode(row.tobytes()).decode() if encoding == "base64" else row
