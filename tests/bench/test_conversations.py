"""Benchmark of issue 11: a conversation's later turns reuse the engine's prompt cache.

Ten turns chained with `previous_response_id`, streamed; time to first text of each turn. The
baselines, same run: turn 1 (short prompt, cold), and turn 10's whole message list sent again
as a fresh request after an unrelated one has taken the cache (same prompt, cold)."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from tests.conftest import Headless

TURNS = 10
ASK = ("Here is one more fact about the lighthouse keeper's island: the north shore has tall cliffs, "
       "the south shore a small harbour with three fishing boats, and a path links them. Note it.")


def first_text(svc: Headless, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds from the request to the first text delta, and the final response."""
    req = urllib.request.Request(svc.url + "/v1/responses", method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {svc.token}"},
        data=json.dumps({"max_output_tokens": 24, "temperature": 0, "stream": True, **body}).encode())
    start = time.perf_counter()
    first, final = 0.0, {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and not first:
                first = time.perf_counter() - start
            elif event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    return first, final


def test_later_turns_reuse_the_prompt_cache(headless: Headless) -> None:
    headless.start()
    headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 2})  # the model loaded
    previous, rows = None, []
    for turn in range(1, TURNS + 1):
        ttft, resp = first_text(headless, {"input": ASK, **({"previous_response_id": previous} if previous else {})})
        usage = resp["usage"]
        rows.append((turn, ttft, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]))
        previous = resp["id"]
    status, listed = headless.get(f"/v1/responses/{previous}/input_items?order=asc&limit=100")
    assert status == 200
    messages = [{"role": i["role"], "content": i["content"][0]["text"]} for i in listed["data"]]
    first_text(headless, {"input": "Something else entirely.", "max_output_tokens": 2})  # takes the cache
    cold, cold_resp = first_text(headless, {"input": messages})
    print()
    for turn, ttft, tokens, cached in rows:
        print(f"turn {turn:2d}: first text after {ttft * 1000:7.1f} ms, prompt {tokens:4d} tokens, "
              f"{cached:4d} from cache")
    last = rows[-1]
    print(f"turn 10's prompt sent cold: first text after {cold * 1000:7.1f} ms, prompt "
          f"{cold_resp['usage']['input_tokens']} tokens, {cold_resp['usage']['input_tokens_details']['cached_tokens']} "
          "from cache")
    print(f"turn 10 / turn 1: {last[1] / rows[0][1]:.2f}x; turn 10 chained / the same prompt cold: "
          f"{last[1] / cold:.2f}x")
    assert last[3] > last[2] * 0.5  # most of turn 10's prompt came from the cache
    assert last[1] < cold  # and that made its first text come sooner
