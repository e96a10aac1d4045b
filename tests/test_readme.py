"""Every example in README.md's "Using it from an app" and "From a terminal" runs, as written, against a
real service."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import ROOT, Headless
from tests.helpers import pair_sync

SECTION = "## Using it from an app"


def _examples(title: str = SECTION) -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(title):].split("\n## ", 1)[0]
    return re.findall(r"```(python|sh)\n(.*?)```", section, flags=re.S)


def _env(svc: Headless) -> dict[str, str]:
    # The README's `.venv/bin/lmsp-tray` is the launcher beside the interpreter running the tests.
    return {**os.environ, "LMSP_URL": svc.url, "LMSP_DATA_DIR": str(svc.data_dir),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _shell(code: str) -> str:
    return code.replace(".venv/bin/lmsp-tray", str(Path(sys.executable).parent / "lmsp-tray"))


def test_the_readme_has_the_examples_it_promises() -> None:
    kinds = [kind for kind, _ in _examples()]
    assert kinds.count("python") == 1 and kinds.count("sh") >= 3


def test_python_pairing_example_with_the_openai_sdk(headless: Headless) -> None:
    headless.start()
    code = next(body for kind, body in _examples() if kind == "python")

    def person_allows() -> None:  # the person at the computer, clicking Allow
        for _ in range(300):
            waiting = headless.get("/v1/pairings")[1]["data"]
            if waiting:
                headless.post(f"/v1/pairings/{waiting[0]['id']}/approve", {})
                return
            time.sleep(0.1)

    helper = threading.Thread(target=person_allows)
    helper.start()
    run = subprocess.run([sys.executable, "-c", code], env=_env(headless), capture_output=True, text=True,
                         timeout=120)
    helper.join()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert re.match(r"Allow 'My notes app' in LMSP Tray; its code is \d{3}-\d{3}$", lines[0])
    assert len(lines) >= 2 and lines[1].strip()  # the model's answer
    assert lines[-1] == "2 vectors of 576 numbers"  # embeddings, after a conversation's second turn


def test_shell_examples_run_in_order(headless: Headless) -> None:
    headless.start()
    env = _env(headless)
    script = "set -euo pipefail\n" + "\n".join(_shell(body) for kind, body in _examples() if kind == "sh")
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert '"output_text"' in out                          # the curl response
    assert len(re.findall(r'"object": ?"embedding"', out)) == 2  # the embeddings example
    assert "event: response.completed" in out or "event: response.incomplete" in out  # the stream ran to its end
    assert f"serving on {headless.url}" in out             # lmsp-tray status
    assert "smollm2-135m-instruct" in out                  # lmsp-tray models / tasks
    assert "No pairing requests are waiting." in out       # lmsp-tray pairings


def test_structured_output_and_tools_example(headless: Headless) -> None:
    """The API tour's example: a parsed object, a forced call, and the answer to the call's result."""
    headless.start()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### Structured output and function tools"):].split("\n### ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    run = subprocess.run([sys.executable, "-c", code], env={**_env(headless), "TOKEN": headless.token},
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert re.match(r"name='.*' country='.*'$", lines[0]), lines
    assert re.match(r"get_weather \{'city': .+\}$", lines[1]), lines
    assert len(lines) >= 3 and lines[2].strip()  # the model's answer after the call's result


def test_ollama_example(headless: Headless) -> None:
    """"Apps that speak Ollama's API": turned on with the owner's token, then the `ollama` package
    with an app's token as OLLAMA_API_KEY."""
    headless.start()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Apps that speak Ollama's API"):].split("\n## ", 1)[0]
    [turn_on] = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    env = _env(headless)
    on = subprocess.run(["bash", "-c", "set -euo pipefail\n" + _shell(turn_on)], env=env, capture_output=True,
                        text=True, timeout=60, cwd=ROOT)
    assert on.returncode == 0, on.stderr
    _, token = pair_sync(headless.url, headless.token, ["models:read", "responses:write"], "ollama app")
    run = subprocess.run([sys.executable, "-c", code], env={**env, "OLLAMA_API_KEY": token}, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0] == "['smollm2-135m-instruct:latest']" and lines[1].strip() and lines[-1] == "576 numbers"


def test_terminal_examples_run_in_order(headless: Headless) -> None:
    headless.start()
    examples = _examples("## From a terminal")
    assert [kind for kind, _ in examples] == ["sh", "sh"]
    script = "set -euo pipefail\n" + "\n".join(_shell(body) for _, body in examples)
    run = subprocess.run(["bash", "-c", script], env=_env(headless), capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for timing in ("total duration:", "load duration:", "prompt eval rate:", "eval count:", "eval rate:"):
        assert timing in run.stderr, run.stderr  # run --verbose
    assert re.search(r"^NAME +ID +SIZE +PROCESSOR +CONTEXT +PARALLEL +UNTIL\n"
                     r"smollm2-135m-instruct +\w{12} .* CPU ", out, flags=re.M), out     # ps, the model loaded
    assert re.search(r"^ID +STATUS +SIZE +DIGEST$", out, flags=re.M), out                 # ls
    assert re.search(r"^ID +STATUS +MODEL +PROGRESS +QUEUE +SLOT +POLICY$", out, flags=re.M), out  # tasks
    assert re.search(r"response\.cancelled|cancelled$", out, flags=re.M), out           # logs -f, to the end
    assert re.search(r"^cancelled$", out, flags=re.M), out                              # tasks --json
    assert re.search(r"^Owner +client_owner", out, flags=re.M), out                     # usage
    assert out.rstrip().endswith("smollm2-135m-instruct: available"), out             # stop
