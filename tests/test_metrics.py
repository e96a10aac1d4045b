"""GET /metrics (Prometheus text format): task counts, tokens, queue depth, request latency,
and who may read it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.helpers import SAY_HI, bearer, pair, raw

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)'
                    r'(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*)?\})?'
                    r' (-?[0-9.e+-]+|\+Inf|NaN)$')


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample line checked against the exposition format; (name, labels) -> value."""
    assert text.endswith("\n")
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    typed: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            typed[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels = frozenset(tuple(kv.split("=", 1)) for kv in (m.group(3) or "").split(",") if kv)
        labels = frozenset((k, v.strip('"')) for k, v in labels)
        key = (m.group(1), labels)
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(m.group(5))
        base = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in typed or base in typed, f"sample without # TYPE: {line!r}"
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def metrics(api: Any) -> dict[Any, float]:
    resp = await api.get("/metrics")
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "text/plain", resp.content_type
    return parse(await resp.text())


async def test_metrics_after_two_completed_responses(api, service):
    before = await metrics(api)
    assert value(before, "lmsp_tasks", state="completed") == 0
    produced = 0
    for _ in range(2):
        resp = await api.post("/v1/responses", json={**SAY_HI, "max_output_tokens": 4})
        assert resp.status == 200, await resp.text()
        produced += (await resp.json())["usage"]["output_tokens"]
    assert produced > 0
    service.tasks.set_paused(True)  # one queued task, to be seen in the queue depth
    resp = await api.post("/v1/responses", json={**SAY_HI, "background": True})
    assert resp.status == 202

    after = await metrics(api)
    assert value(after, "lmsp_tasks", state="completed") == 2
    assert value(after, "lmsp_tasks", state="queued") == 1
    for state in ("loading", "running", "cancelling", "failed", "cancelled"):
        assert value(after, "lmsp_tasks", state=state) == 0, state
    assert value(after, "lmsp_queue_depth") == 1
    assert value(after, "lmsp_tokens_generated_total") >= produced
    assert value(after, "lmsp_decode_tokens_per_second") > 0

    # The latency histogram: cumulative buckets, +Inf equal to the count, which grew.
    buckets = sorted(((float(dict(labels)["le"]), v) for (name, labels), v in after.items()
                      if name == "lmsp_request_seconds_bucket"), key=lambda b: b[0])
    assert len(buckets) > 5 and buckets[-1][0] == float("inf")
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)
    assert buckets[-1][1] == value(after, "lmsp_request_seconds_count")
    assert value(after, "lmsp_request_seconds_count") >= value(before, "lmsp_request_seconds_count") + 3
    assert value(after, "lmsp_request_seconds_sum") > 0


async def test_metrics_scope(api):
    _, reader = await pair(api, ["metrics:read"])
    resp, text = await raw(api, "GET", "/metrics", headers=bearer(reader))
    assert resp.status == 200, text
    assert "lmsp_tasks{" in text and "lmsp_queue_depth" in text
    parse(text)
    _, other = await pair(api, ["responses:read", "responses:write", "tasks:read", "models:read"])
    resp, text = await raw(api, "GET", "/metrics", headers=bearer(other))
    assert resp.status == 403 and '"insufficient_scope"' in text, text
    resp, text = await raw(api, "GET", "/metrics")
    assert resp.status == 401 and '"unauthorized"' in text, text
    resp, text = await raw(api, "GET", "/metrics", headers=bearer("lmsp_not-a-real-token"))
    assert resp.status == 401, text
