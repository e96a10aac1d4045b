"""Prompts without a chat template, through Ollama's `/api/generate` (the official `ollama`
package) and `/v1/responses`, on real llama.cpp: a `raw` prompt reaches the model as it is, and a
`suffix` is framed in the model's own fill-in-the-middle tokens, or refused where it has none."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ollama
import pytest

from app import paths
from app.engine.registry import gguf
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.engine.template import SLOTS, ChatTemplate
from tests.conftest import Headless
from tests.helpers import pair_sync
from tests.test_templates import with_template

pytestmark = pytest.mark.llama
NAME = f"{DEFAULT_MODEL_ID}:latest"
GREEDY = {"temperature": 0, "num_predict": 12}
QUESTION = "What is the capital of France?"
# Three of the default model's own control tokens named as its fill-in-the-middle tokens (it has
# none): what they mean to it does not matter here, only where they are put.
FIM = {"tokenizer.ggml.fim_pre_token_id": 6, "tokenizer.ggml.fim_suf_token_id": 7,
       "tokenizer.ggml.fim_mid_token_id": 8}


@pytest.fixture
def client(headless: Headless) -> Any:
    headless.start()
    assert headless.request("PATCH", "/v1/settings", {"ollama_api": "token"})[0] == 200
    _, token = pair_sync(headless.url, headless.token, ["models:read", "models:write", "responses:write"], "editor")
    return ollama.Client(host=headless.url, headers={"Authorization": f"Bearer {token}"}, timeout=180)


def rendered(messages: list[dict[str, str]]) -> str:
    """The default model's prompt for `messages`, as its chat template writes it."""
    with open(paths.default_model_file(), "rb") as f:
        text = gguf.read(f).chat_template
    assert text is not None
    return SLOTS.sub(lambda m: messages[int(m[1])]["content"],
                     ChatTemplate(text, "<|im_start|>", "<|im_end|>").render(messages))


def vocabulary(ids: list[int]) -> list[str]:
    """The texts of token `ids`, as the model's own tokenizer writes them (from its GGUF)."""
    data = paths.default_model_file().read_bytes()[:4 << 20]
    at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4 + 8
    texts = []
    for _ in range(max(ids) + 1):
        n = struct.unpack_from("<Q", data, at)[0]
        texts.append(data[at + 8:at + 8 + n].decode())
        at += 8 + n
    return [texts[i] for i in ids]


def test_a_raw_prompt_is_the_model_s_whole_input(client: Any) -> None:
    templated = client.generate(model=NAME, prompt=QUESTION, options=GREEDY)
    # The template's own text sent raw: its markers read as the model's special tokens, nothing added.
    raw = client.generate(model=NAME, prompt=rendered([{"role": "user", "content": QUESTION}]), raw=True,
                          options=GREEDY)
    assert raw.response == templated.response and raw.prompt_eval_count == templated.prompt_eval_count
    # A raw text is continued as text, not answered as a chat turn: no system turn, no markers.
    plain = client.generate(model=NAME, prompt="The capital of France is", raw=True, options=GREEDY)
    assert plain.prompt_eval_count < 10 < templated.prompt_eval_count, plain
    # Ollama leaves `system` out of a raw prompt, and so do we.
    told = client.generate(model=NAME, prompt="The capital of France is", raw=True, system="Answer in French.",
                           options=GREEDY)
    assert told.response == plain.response and told.prompt_eval_count == plain.prompt_eval_count


def test_a_suffix_needs_fill_in_the_middle_tokens(client: Any, headless: Headless) -> None:
    shown = client.show(NAME)
    assert shown.capabilities == ["completion", "tools", "embedding"]  # no `insert`
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model=NAME, prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))")
    assert refused.value.status_code == 400 and "fill-in-the-middle" in refused.value.error
    status, body = headless.request("POST", "/v1/responses", {"input": "def f():", "suffix": "\n", "raw": True})
    assert status == 400 and body["error"]["param"] == "suffix", body
    status, body = headless.request("POST", "/v1/responses", {"input": [{"role": "user", "content": "x"}],
                                                              "raw": True})
    assert status == 400 and body["error"]["param"] == "input", body
    status, body = headless.request("POST", "/api/generate", {"model": NAME, "prompt": "x", "raw": "yes"})
    assert status == 400 and "`raw` must be true or false" in json.dumps(body), body


def test_a_suffix_is_framed_in_the_model_s_own_tokens(client: Any, headless: Headless, tmp_path: Path) -> None:
    coder = tmp_path / "coder.gguf"
    with_template(paths.default_model_file(), coder, None, FIM)
    status, body = headless.request("POST", "/v1/models", {"path": str(coder), "id": "coder"})
    assert status in (200, 201), body
    assert "insert" in client.show("coder").capabilities
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"
    filled = client.generate(model="coder", prompt=prefix, suffix=suffix, options=GREEDY)
    # The same tokens written out and sent raw: the prefix token, the text before the gap, the
    # suffix token, the text after it, the middle token; the model goes on from there alike.
    pre, suf, mid = vocabulary(list(FIM.values()))
    written = client.generate(model="coder", prompt=f"{pre}{prefix}{suf}{suffix}{mid}", raw=True, options=GREEDY)
    assert filled.prompt_eval_count == written.prompt_eval_count and filled.response == written.response
    assert filled.response, filled
    # /v1/responses takes the same request, and says the same.
    status, body = headless.request("POST", "/v1/responses", {"model": "coder", "input": prefix, "suffix": suffix,
                                                              "temperature": 0, "max_output_tokens": 12})
    assert status == 200 and body["output_text"] == filled.response, body


def test_a_template_override_makes_the_prompt_as_ollama_does(client: Any) -> None:
    """`template` (Go's template language, as Ollama's Modelfiles write it) over `system` and
    `prompt`, up to `.Response`: the model reads what it renders, as a raw prompt."""
    chatml = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}<|im_start|>user\n"
              "{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n{{ .Response }}<|im_end|>\n")
    system = "Answer in one word."
    templated = client.generate(model=NAME, prompt=QUESTION, system=system, template=chatml, options=GREEDY)
    written = rendered([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    raw = client.generate(model=NAME, prompt=written, raw=True, options=GREEDY)
    assert templated.response == raw.response and templated.prompt_eval_count == raw.prompt_eval_count, templated
    plain = client.generate(model=NAME, prompt=QUESTION, template="Q: {{ .Prompt }}\nA:{{ .Response }}",
                            options=GREEDY)
    assert plain.prompt_eval_count < 20 and plain.response, plain  # no chat turns, no system turn
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model=NAME, prompt=QUESTION, template="{{ range .Messages }}{{ .Content }}{{ end }}")
    assert refused.value.status_code == 400 and "range .Messages" in refused.value.error
