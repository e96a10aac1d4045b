"""The official `ollama` npm package under Node, unchanged, against a real headless service with
scripted engines (`make test` installs it with `npm ci` in tests/ollama_js)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.conftest import ROOT, Headless
from tests.helpers import pair_sync

pytestmark = pytest.mark.scripted(length=6)
FOLDER = ROOT / "tests" / "ollama_js"
NAME = f"{DEFAULT_MODEL_ID}:latest"


def test_the_ollama_npm_package(headless: Headless) -> None:
    assert shutil.which("node"), "Node.js is needed for this test"
    assert (FOLDER / "node_modules" / "ollama").is_dir(), "run `npm ci` in tests/ollama_js (make test does)"
    headless.start()
    assert headless.request("PATCH", "/v1/settings", {"ollama_api": "token"})[0] == 200
    _, token = pair_sync(headless.url, headless.token, ["models:read", "responses:write"], "ollama-js")
    run = subprocess.run(["node", "check.mjs"], cwd=FOLDER, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OLLAMA_HOST": headless.url, "LMSP_TOKEN": token, "MODEL": NAME})
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["models"] == [NAME] and got["capabilities"] == ["completion", "tools", "embedding"]
    assert got["chat"] == "1, 2, 3, 4, 5, 6" and got["last"]["done"] and got["last"]["done_reason"] == "stop"
    assert got["generate"] == "1, 2, 3, 4, 5, 6" and got["running"] == [NAME]
    assert got["missing"]["status"] == 404 and "nothing:7b" in got["missing"]["message"]
