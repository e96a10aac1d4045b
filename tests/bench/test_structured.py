"""Benchmark (`make bench`): what a JSON-schema grammar costs while decoding. The same prompt,
the same number of tokens, in the same service, with and without `text.format`; the ratio is
the task's decode rate (tokens/s as the runner measures it) with the grammar over without."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import Headless
from tests.helpers import COUNT

TOKENS = 128
ROUNDS = 2
# The numbers as a JSON array: as long as the plain answer, and it cannot end before TOKENS.
NUMBERS = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                        "minItems": 500}},
           "required": ["numbers"], "additionalProperties": False}


def decode_rate(svc: Headless, extra: dict[str, Any]) -> float:
    task = svc.complete({"input": COUNT, "temperature": 0, "max_output_tokens": TOKENS, **extra}, timeout=300)
    assert task["progress"]["output_tokens"] == TOKENS, task
    return float(task["progress"]["tokens_per_second"])


@pytest.mark.timeout(1800)  # decoding 5 x 128 tokens on a machine other work may be sharing
def test_json_schema_grammar_decode_rate_vs_unconstrained(headless: Headless) -> None:
    headless.start()
    grammar = {"text": {"format": {"type": "json_schema", "name": "numbers", "schema": NUMBERS, "strict": True}}}
    decode_rate(headless, {})  # load and warm the model
    plain, constrained = [], []
    for _ in range(ROUNDS):  # interleaved, so a busy moment of the machine weighs on both
        plain.append(decode_rate(headless, {}))
        constrained.append(decode_rate(headless, grammar))
    ratio = max(constrained) / max(plain)
    print(f"\n[bench] decode, {TOKENS} tokens, best of {ROUNDS}: unconstrained {max(plain):.1f} tokens/s; "
          f"with a JSON-schema grammar {max(constrained):.1f} tokens/s; ratio {ratio:.3f} "
          f"(all: {json.dumps({'plain': plain, 'grammar': constrained})})")
    assert ratio > 0.3  # a grammar that cost more than that would be a bug, not a price
