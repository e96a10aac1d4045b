"""Property-based run of every documented operation against the live service (schemathesis),
and regression tests for what such runs found.

One real `lmsp-tray --headless` process, and the OpenAPI document it serves at /openapi.json.
For each operation, schema-valid (positive) and schema-violating (negative) requests are sent
with the owner token: the service must never answer 5xx and never hang (a per-request timeout).

The two routes that run a model would spend the whole budget generating. So the main pass sends
their generated bodies with a `model` that does not exist: every field is still parsed and
validated (the model is looked up last) and the answer comes at once (400, or 404
`model_not_found`). A short pass then runs a few small generated requests for real on the
default model, with `max_output_tokens` capped at 4.

`LMSP_FUZZ_CHECKS=not_a_server_error,response_schema_conformance,...` runs other schemathesis
checks too (e.g. to audit app/resources/openapi.yaml against the answers); the default is only
`not_a_server_error`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

MAX_EXAMPLES = 25          # per operation and generation mode
REAL_EXAMPLES = 3          # per generation route, run on the real model
REQUEST_TIMEOUT = 15.0     # seconds; longer than any answer should take: a hang fails the run
REAL_TIMEOUT = 60.0        # a real generation, behind whatever is queued, on a busy machine
MAX_TOKENS = 4
NO_MODEL = "lmsp-fuzz-no-such-model"
GENERATING = {"POST /v1/responses": "max_output_tokens", "POST /v1/chat/completions": "max_completion_tokens"}
# Routes whose bodies name a model: the main pass points them at NO_MODEL (embeddings run for
# real in tests/test_embeddings.py).
MODEL_ROUTES = {*GENERATING, "POST /v1/embeddings"}
# Last: its positive examples change the live settings (e.g. max_concurrent_tasks up to 16).
LAST = "PATCH /v1/settings"


def _checks() -> list[Any]:
    from schemathesis.checks import CHECKS, load_all_checks, not_a_server_error

    names = os.environ.get("LMSP_FUZZ_CHECKS")
    if not names:
        return [not_a_server_error]
    load_all_checks()
    return list(CHECKS.get_by_names(names.split(",")))


def _valid_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def no_model(case: Any) -> Any:
    """Point a body that names no model, or a well-formed one, at a model that does not exist."""
    if case.operation.label in MODEL_ROUTES and isinstance(case.body, dict):
        if case.body.get("model") is None or isinstance(case.body["model"], str):
            case.body["model"] = NO_MODEL
    return case


def real_model(case: Any) -> Any:
    """On the default model (a well-formed model id would only be a quick 404), and short: a request
    that would be accepted generates at most MAX_TOKENS tokens (`max_completion_tokens` wins over
    `max_tokens` in chat); a value the server must refuse is left as it is."""
    field = GENERATING.get(case.operation.label)
    if field and isinstance(case.body, dict):
        if case.body.get("model") is None or isinstance(case.body["model"], str):
            case.body.pop("model", None)
        value = case.body.get(field)
        if value is None or (_valid_count(value) and value > MAX_TOKENS):
            case.body[field] = MAX_TOKENS
    return case


def small(case: Any) -> bool:
    """Real runs: a prompt of a few hundred characters at most, so it is quick to evaluate."""
    return len(json.dumps(case.body)) < 600


def _has_inputs(operation: Any) -> bool:
    """Anything negative data can be made of: a body, or a query or header parameter (a broken path
    parameter cannot be sent: it is a string in the URL either way)."""
    return bool(operation.body) or any(p.location in ("query", "header") for p in operation.iter_parameters())


def _explain(exc: BaseException) -> str:
    """The failure itself, also from inside hypothesis' wrappers (flaky, multiple failures)."""
    parts = [f"{type(exc).__name__}: {exc}"]
    parts += [_explain(inner) for inner in getattr(exc, "exceptions", ())]
    if exc.__cause__ is not None:
        parts.append(_explain(exc.__cause__))
    return "\n  ".join(parts)


class Fuzzer:
    def __init__(self, url: str, token: str) -> None:
        import requests

        self.url = url
        self.auth = {"Authorization": f"Bearer {token}"}
        self.session = requests.Session()
        self.checks = _checks()
        self.failures: list[str] = []
        self.timings: dict[str, float] = {}
        self.calls = 0

    def run(self, operation: Any, mode: Any, examples: int, timeout: float, adjust: Callable[[Any], Any],
            keep: Callable[[Any], bool] = lambda case: True, tag: str = "") -> None:
        import requests
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis.errors import Unsatisfiable

        strategy = operation.as_strategy(generation_mode=mode).map(adjust).filter(keep)

        @given(case=strategy)
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            self.calls += 1
            curl = case.as_curl_command(headers=self.auth, base_url=self.url)
            try:
                response = case.call(base_url=self.url, session=self.session, headers=self.auth, timeout=timeout)
            except requests.exceptions.Timeout:
                raise AssertionError(f"no answer within {timeout} s:\n{curl}") from None
            try:
                case.validate_response(response, checks=self.checks)
            except (Exception, BaseExceptionGroup) as exc:  # schemathesis reports a FailureGroup
                raise AssertionError(f"{response.status_code} {response.text[:300]}\n{curl}") from exc

        label = f"{operation.label} [{mode.value}{tag}]"
        began = time.monotonic()
        try:
            check()
        except Unsatisfiable:
            pass  # nothing of this kind can be generated for this operation
        except (Exception, BaseExceptionGroup) as exc:  # collect: one run reports every failing operation
            self.failures.append(f"{label}: {_explain(exc)}")
        self.timings[label] = time.monotonic() - began


@pytest.fixture
def hypothesis_home(tmp_path: Path) -> Any:
    """Keep hypothesis' cache out of the working tree."""
    pytest.importorskip("schemathesis", minversion="4.0")  # the v4 Python API; hypothesis comes with it
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(tmp_path / "hypothesis")
    yield
    set_hypothesis_home_dir(None)


@pytest.fixture
def empty_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The download routes ask this hub on loopback (with no repositories), never the internet."""
    from tests.hub_server import FakeHub

    hub = FakeHub({}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    yield hub
    hub.stop()


def test_no_server_error_and_no_hang_on_any_operation(hypothesis_home: Any, empty_hub: Any, headless: Any) -> None:
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    headless.start()
    # Ollama's API answers only once turned on: on, so that its routes are fuzzed too.
    assert headless.request("PATCH", "/v1/settings", {"ollama_api": "token"})[0] == 200
    # The document the live service serves (from_url would leave out GET /openapi.json itself).
    served = requests.get(headless.url + "/openapi.json", timeout=REQUEST_TIMEOUT)
    assert served.status_code == 200
    schema = schemathesis.openapi.from_dict(served.json())
    operations = sorted((result.ok() for result in schema.get_all_operations()), key=lambda op: op.label == LAST)
    assert len(operations) == 48

    fuzz = Fuzzer(headless.url, headless.token)
    started = time.monotonic()
    for operation in operations:
        if operation.label == LAST:  # real runs before the settings change how work runs
            for real in operations:
                if real.label in GENERATING:
                    fuzz.run(real, GenerationMode.POSITIVE, REAL_EXAMPLES, REAL_TIMEOUT, real_model, small,
                             tag=", real model")
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if _has_inputs(operation) else [])
        for mode in modes:
            fuzz.run(operation, mode, MAX_EXAMPLES, REQUEST_TIMEOUT, no_model)

    slowest = sorted(fuzz.timings.items(), key=lambda kv: -kv[1])[:3]
    print(f"\nschemathesis: {fuzz.calls} requests, {len(fuzz.timings)} runs over {len(operations)} operations "
          f"in {time.monotonic() - started:.1f} s; slowest: " + ", ".join(f"{k} {v:.1f} s" for k, v in slowest))
    assert headless.proc is not None and headless.proc.poll() is None, "the service died during the run"
    assert headless.get("/health")[0] == 200
    assert not fuzz.failures, "\n\n".join(fuzz.failures)
    assert fuzz.calls >= len(operations) * 10, fuzz.calls


# -- what the runs found --------------------------------------------------------------------------

SHORT = aiohttp.ClientTimeout(total=10)


@pytest.mark.parametrize("raw", [
    b'{"client_name": "\\ud800", "scopes": ["admin"]}',      # a lone surrogate: not text, cannot be stored
    b'{"client_name": "a", "scopes": ["admin"], "n": ' + b"1" * 5000 + b"}",  # over Python's 4300 digits
    b"[" * 100_000,                                           # nesting deeper than the parser's recursion
])
async def test_unusable_json_is_400_not_500(api: Any, raw: bytes) -> None:
    resp = await api.post("/v1/pairings", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_json"


async def test_lone_surrogate_with_idempotency_key_is_400(api: Any) -> None:
    resp = await api.post("/v1/responses", data=b'{"input": "\\ud800", "background": true}',
                          headers={"Idempotency-Key": "k1", "Content-Type": "application/json"})
    assert resp.status == 400
    # A surrogate pair (an emoji written as escapes) is ordinary text.
    resp = await api.post("/v1/pairings", data=b'{"client_name": "\\ud83d\\ude00", "scopes": ["admin"]}')
    assert resp.status == 202
    assert (await resp.json())["client_name"] == "\U0001F600"


async def test_unusable_model_path_is_400(api: Any) -> None:
    resp = await api.post("/v1/models", json={"path": "/" + "a" * 300 + ".gguf"})  # ENAMETOOLONG
    body = await resp.json()
    assert resp.status == 400, body
    assert body["error"]["param"] == "path"


async def test_event_cursors_beyond_sqlite_integers_are_400(api: Any) -> None:
    resp = await api.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, "background": True})
    created = await resp.json()
    task_id, response_id = created["task"]["id"], created["id"]
    # Each error names the cursor as the client sent it.
    for url, headers, name in ((f"/v1/tasks/{task_id}/events?after={2**63}", {}, "after"),
                               (f"/v1/tasks/{task_id}/events?stream=true", {"Last-Event-ID": str(2**64)},
                                "Last-Event-ID"),
                               (f"/v1/tasks/{task_id}/events?stream=true", {"Last-Event-ID": "xyz"}, "Last-Event-ID"),
                               (f"/v1/responses/{response_id}?stream=true&starting_after={2**63}", {},
                                "starting_after"),
                               (f"/v1/responses/{response_id}?stream=true&starting_after=abc", {}, "starting_after")):
        resp = await api.get(url, headers=headers)
        assert resp.status == 400, url
        error = (await resp.json())["error"]
        assert error["param"] == name and f"`{name}`" in error["message"], (url, error)
    resp = await api.get(f"/v1/tasks/{task_id}/events?after={2**63 - 1}")
    assert resp.status == 200 and (await resp.json())["data"] == []


async def test_stream_after_the_last_event_of_a_finished_task_closes(api: Any) -> None:
    """An SSE client that reconnects with the terminal event's id (EventSource does) used to get
    heartbeats forever; with a cursor past the end, too. Nothing more can come: the stream closes."""
    resp = await api.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
    final = await resp.json()
    assert final["status"] in ("completed", "incomplete")
    task = await (await api.get(f"/v1/tasks/{final['task']['id']}")).json()
    last = task["last_sequence_number"]
    reconnect = {"Accept": "text/event-stream", "Last-Event-ID": str(last)}
    for url, headers in ((f"/v1/tasks/{task['id']}/events", reconnect),
                         (f"/v1/tasks/{task['id']}/events?stream=true&after={last + 50}", {}),
                         (f"/v1/responses/{final['id']}?stream=true&starting_after={last}", {})):
        resp = await api.get(url, headers=headers, timeout=SHORT)
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        assert await resp.text() == "", url  # at once, and empty
    # From one before the end: exactly the terminal event, then closed.
    resp = await api.get(f"/v1/tasks/{task['id']}/events?stream=true&after={last - 1}", timeout=SHORT)
    text = await resp.text()
    assert text.startswith(f"id: {last}\nevent: response.") and text.count("id: ") == 1
