"""The requests apps built for Ollama send, as they send them (method, path, headers, body),
against the Ollama listener with scripted engines: Open WebUI's startup and Continue's chat and
fill-in-the-middle completions. Each answer is read the way the app reads it."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.conftest import Headless, free_port

pytestmark = pytest.mark.scripted(length=6)
NAME = f"{DEFAULT_MODEL_ID}:latest"
OPEN_WEBUI = {"Content-Type": "application/json", "User-Agent": "Python/3.11 aiohttp/3.11.11"}
CONTINUE = {"Content-Type": "application/json", "User-Agent": "node-fetch"}


def _send(url: str, method: str, path: str, headers: dict[str, str], body: Any = None) -> tuple[int, str, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read()


@pytest.fixture
def ollama_url(headless: Headless) -> str:
    headless.start()
    port = free_port()
    status, body = headless.request("PATCH", "/v1/settings", {"ollama_api": "open", "ollama_port": port})
    assert status == 200, body
    return f"http://127.0.0.1:{port}"


def test_open_webui_startup(ollama_url: str) -> None:
    status, _, text = _send(ollama_url, "GET", "/", OPEN_WEBUI)
    assert (status, text) == (200, b"Ollama is running")
    assert _send(ollama_url, "HEAD", "/", OPEN_WEBUI)[0] == 200
    version = json.loads(_send(ollama_url, "GET", "/api/version", OPEN_WEBUI)[2])["version"]
    assert all(part.isdigit() for part in version.split("."))  # it compares the numbers
    tags = json.loads(_send(ollama_url, "GET", "/api/tags", OPEN_WEBUI)[2])
    names = [m["model"] for m in tags["models"]]
    assert names == [NAME] and tags["models"][0]["name"] == NAME
    running = json.loads(_send(ollama_url, "GET", "/api/ps", OPEN_WEBUI)[2])
    assert running == {"models": []}
    for name in names:  # the older `name` field and the newer `model`, with and without the tag
        for body in ({"name": name}, {"model": name}, {"model": name.removesuffix(":latest")}):
            shown = json.loads(_send(ollama_url, "POST", "/api/show", OPEN_WEBUI, body)[2])
            assert "completion" in shown["capabilities"] and shown["details"]["format"] == "gguf"
            assert shown["model_info"][f"{shown['model_info']['general.architecture']}.context_length"] == 4096


def test_continue_show_chat_and_fill_in_the_middle(ollama_url: str) -> None:
    shown = json.loads(_send(ollama_url, "POST", "/api/show", CONTINUE, {"name": NAME})[2])
    assert shown["parameters"].split("\n")[0] == "num_ctx 4096" and isinstance(shown["template"], str)
    options = {"temperature": 0.01, "top_p": 0.9, "top_k": 40, "num_predict": 8, "num_ctx": 8192, "mirostat": 0,
               "num_thread": 4, "use_mmap": True, "min_p": 0.0, "num_gpu": 0}
    status, kind, raw = _send(ollama_url, "POST", "/api/chat", CONTINUE, {
        "model": NAME, "stream": True, "keep_alive": 1800, "options": {**options, "stop": ["<|im_end|>"]},
        "messages": [{"role": "system", "content": "You are a coding assistant."},
                     {"role": "user", "content": "Count"}]})
    lines = [json.loads(line) for line in raw.splitlines()]
    assert (status, kind) == (200, "application/x-ndjson")
    assert "".join(line["message"]["content"] for line in lines) == "1, 2, 3, 4,"  # 8 tokens
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "length"
    status, kind, raw = _send(ollama_url, "POST", "/api/generate", CONTINUE, {
        "model": NAME, "raw": True, "stream": True, "keep_alive": 1800, "prompt": "def count():\n    return ",
        "suffix": "\n\nprint(count())\n",
        "options": {**options, "stop": ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                                        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|im_start|>",
                                        "<|im_end|>", "\n\n"]}})
    lines = [json.loads(line) for line in raw.splitlines()]
    assert status == 200 and "".join(line["response"] for line in lines) == "1, 2, 3, 4," and lines[-1]["done"]
