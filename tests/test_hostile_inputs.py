"""The rule behind the red-team round of 2026-12-05, checked on a real service: nothing a client
sends may hold the event loop for more than a few milliseconds, hold an engine after the client
left, or hold memory or disk beyond a budget that the limits count.

Each case below sends one endpoint's worst legal input, as a paired app with the scopes it needs
would (a new endpoint's worst input is one more `@case`; tests/hostile_tokenless.py's, apps
without a token on the Ollama listener, register here too). For every case, on a fresh
`lmsp-tray --headless` with the default model (scripted engines where the input never reaches
llama.cpp):

1. a probe in its own process does GET /health every 50 ms: its slowest round trip (p100)
   during the case must stay <= LAG_BOUND (plus CONNECTION_COST for each connection a case
   opens at once: the probe's comes behind them), and every one must be answered;
2. each request the case sends ends, within the time it states, in a clear LMSP 4xx error or a
   success (never a 5xx, never a wait past that time: the client then leaves);
3. once the case's client has left, another app's 2-token /v1/responses completes within
   ENGINE_BOUND + its own idle time (measured first, in the same run);
4. the service's RSS grows by at most RSS_BUDGET, and the database and its WAL by at most twice
   what the limits counted meanwhile, plus DISK_SLACK (twice: a row's pages are in the WAL and,
   after a checkpoint, in the file too; the WAL is not truncated).

A case that fails prints every figure it measured, so the failure says how far off it is.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests import hostile_tokenless
from tests.conftest import Headless, Processes
from tests.helpers import pair_sync
from tests.hostile import ENGINE_BOUND, MIB, Attack, Probe, counted_mib, exchange, rss_kib, stored_mib

LAG_BOUND = 0.100    # s: the slowest /health round trip while a case runs
# s: what a new connection and its request cost the loop, accepted, parsed, answered (even a 429)
# and closed. Connections are answered in the order they came, so a probe that comes behind 300
# waits for all of them: 300 x 0.35 ms, measured here, most of it aiohttp's and the kernel's.
CONNECTION_COST = 0.0005
RSS_BUDGET = 256.0   # MiB: the service's RSS growth over a case (the probe samples it every 50 ms)
DISK_SLACK = 4.0     # MiB: database and WAL growth beyond twice the bytes the limits counted
TWO_TOKENS = {"input": "Say hi", "max_output_tokens": 2, "temperature": 0}
WRITER = ("responses:write", "responses:read", "tasks:read", "tasks:cancel")
MODELER = ("models:write", "models:read")
pytestmark = pytest.mark.alone  # its bounds are milliseconds of lag: no other test beside it


@dataclass(frozen=True)
class Case:
    run: Callable[[Attack, Headless], None]
    scopes: tuple[str, ...]
    llama: bool  # whether what the case sends reaches llama.cpp; if not, the app runs scripted engines
    burst: int  # connections the case opens at once

    @property
    def lag_bound(self) -> float:
        return LAG_BOUND + self.burst * CONNECTION_COST


CASES: dict[str, Case] = {}


def case(name: str, scopes: tuple[str, ...] = WRITER, llama: bool = False, burst: int = 0
         ) -> Callable[[Callable[[Attack, Headless], None]], Callable[[Attack, Headless], None]]:
    """Register `run(attack, service)`, which sends one endpoint's worst input as `attack`. A case
    whose input never reaches llama.cpp (it is refused, or costs the service before any engine)
    runs on scripted engines (tests/scripted.py): the same service, without a model to load."""
    def register(run: Callable[[Attack, Headless], None]) -> Callable[[Attack, Headless], None]:
        CASES[name] = Case(run, scopes, llama, burst)
        return run
    return register


# -- the cases ---------------------------------------------------------------------------------

@case("control-an-ordinary-request", llama=True)
def _ordinary(attack: Attack, _: Headless) -> None:
    """What every bound is measured against: an ordinary app's request passes them all."""
    attack.send("/v1/responses", {"input": "Say hi", "max_output_tokens": 8}, within=10, what="an ordinary request")


ITEMS = 60_000  # 3.5 MB of the smallest items: red team N2, 114 s of frozen service


@case("N2-responses-60000-function-call-outputs")
def _items_to_responses(attack: Attack, _: Headless) -> None:
    item = {"type": "function_call_output", "call_id": "c", "output": ""}
    attack.send("/v1/responses", {"input": [item] * ITEMS, "max_output_tokens": 1}, within=10,
                what=f"{ITEMS} function_call_output items to /v1/responses")


@case("N2-chat-60000-tool-messages")
def _items_to_chat(attack: Attack, _: Headless) -> None:
    message = {"role": "tool", "tool_call_id": "c", "content": ""}
    attack.send("/v1/chat/completions", {"messages": [message] * ITEMS, "max_tokens": 1}, within=10,
                what=f"{ITEMS} tool messages to /v1/chat/completions")


def _tool_calls_each_way(count: int) -> bytes:
    """An Ollama chat of `count` calls of `a`, `count` of `b`, then `count` answers to `b`: each
    answer was matched by looking through every `a` before it (red team P2: 14 000 took 61 s, on
    both request-reader threads, before the item cap refused it)."""
    calls = [{"function": {"name": "a"}}] * count + [{"function": {"name": "b"}}] * count
    messages = [{"role": "assistant", "tool_calls": calls}] + [{"role": "tool", "tool_name": "b"}] * count
    return json.dumps({"model": DEFAULT_MODEL_ID, "messages": messages, "stream": False},
                      separators=(",", ":")).encode()


def _ollama_tool_calls(attack: Attack, count: int, within: float, may_leave: bool) -> None:
    """Two such chats at once on Ollama's API, by an app paired with `responses:write`."""
    status, _ = exchange(attack.url, "PATCH", "/v1/settings", json.dumps({"ollama_api": "token"}).encode(),
                         {"Authorization": f"Bearer {attack.owner}"})
    assert status == 200
    body = _tool_calls_each_way(count)
    chats = [threading.Thread(target=attack.send, args=("/api/chat", body),
                              kwargs={"within": within, "may_leave": may_leave,
                                      "what": f"Ollama chat {i + 1}/2: {count} tool calls each way "
                                              f"({len(body) / 1e6:.2f} MB)"})
             for i in range(2)]
    for chat in chats:
        chat.start()
    for chat in chats:
        chat.join()


@case("P2-ollama-chat-14000-tool-calls-each-way-twice")
def _ollama_tool_calls_twice(attack: Attack, _: Headless) -> None:
    _ollama_tool_calls(attack, 14_000, within=10, may_leave=False)


@case("P2-ollama-chat-10000-tool-calls-each-way-twice-clients-leave-after-1s")
def _ollama_tool_calls_and_leave(attack: Attack, _: Headless) -> None:
    _ollama_tool_calls(attack, 10_000, within=1, may_leave=True)


def _json_schema(schema: dict[str, object], prompt: str = "hi", tokens: int = 2) -> dict[str, object]:
    return {"input": prompt, "max_output_tokens": tokens, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}


def _colliding(count: int, required: bool) -> dict[str, object]:
    """Property names that differ only in characters llama.cpp's converter maps to "-": every rule
    name collides (red team N3: 900 optional took 30 s on the loop, 8 000 required 8 s)."""
    names = ["a" + chr(0x100 + i) for i in range(count)]
    return {"type": "object", "properties": {n: {} for n in names}, **({"required": names} if required else {})}


@case("N3-schema-900-colliding-optional-properties")
def _colliding_optional(attack: Attack, _: Headless) -> None:
    attack.send("/v1/responses", _json_schema(_colliding(900, required=False)), within=10,
                what="a schema of 900 colliding optional properties")


@case("N3-schema-8000-colliding-required-properties")
def _colliding_required(attack: Attack, _: Headless) -> None:
    attack.send("/v1/responses", _json_schema(_colliding(8000, required=True)), within=10,
                what="a schema of 8 000 colliding required properties")


@case("N5-schema-200000-value-enum")
def _huge_enum(attack: Attack, _: Headless) -> None:
    schema = {"type": "object", "properties": {"v": {"enum": [f"v{i:07d}" for i in range(200_000)]}},
              "required": ["v"]}
    attack.send("/v1/responses", _json_schema(schema, "Pick one value.", 12), within=10,
                what="a 200 000-value enum (2.4 MB)")


def _engine_mode(attack: Attack) -> str:
    _, text = exchange(attack.url, "GET", f"/v1/models/{DEFAULT_MODEL_ID}",
                       headers={"Authorization": f"Bearer {attack.owner}"})
    return str(json.loads(text)["engine"]["mode"])


def _unsatisfiable(pattern: str) -> Callable[[Attack, Headless], None]:
    """A pattern nothing matches (N1: llama.cpp aborts, and the model went to safe mode for good),
    or one llama.cpp cannot parse (N14): a 400 unsupported_schema, and the engine untouched."""
    def run(attack: Attack, service: Headless) -> None:
        engines, mode = service.engine_pids(), _engine_mode(attack)
        schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}, "required": ["v"]}
        attack.send("/v1/responses", _json_schema(schema, "Write v.", 8), within=10, expect=400,
                    code="unsupported_schema", what=f"pattern {pattern!r}")
        now, mode_now = service.engine_pids(), _engine_mode(attack)
        attack.note(f"engine processes {engines} -> {now}, mode {mode} -> {mode_now}")
        attack.bound(now == engines, f"the engine process lived on (it was replaced: {engines} -> {now})")
        attack.bound(mode_now == mode, f"the model stayed in {mode} mode (now {mode_now})")
    return run


for _name, _pattern in (("N1-pattern-nul", r"^\u0000$"), ("N14-pattern-empty-negated-class", r"^[^\s\S]$"),
                        ("N14-pattern-empty-class", r"^[]$")):
    case(_name)(_unsatisfiable(_pattern))


def _digits(count: int, length: int) -> list[str]:
    """Random digits: one token per character, so the most tokens a body of this size can carry."""
    text = "".join(random.choices("0123456789", k=count * length))
    return [text[i * length:(i + 1) * length] for i in range(count)]


@case("N4-embeddings-2048-inputs-of-4000-digits-client-leaves-after-1s", llama=True)
def _embedding_batch(attack: Attack, _: Headless) -> None:
    texts = _digits(2048, 4000)  # 7.8 MiB, under the 8 MiB body limit
    attack.send("/v1/embeddings", {"input": texts}, within=1, may_leave=True,
                what="2 048 embedding inputs of 4 000 digits (7.8 MiB)")


@case("N8-ten-embeddings-under-idempotency-keys", llama=True)
def _stored_embeddings(attack: Attack, _: Headless) -> None:
    """Each answer was stored under its key for a day, outside every limit: 2 048 short inputs
    make 25 MB of JSON (red team N8: ten of them, 254 MiB). The disk bound of every case catches
    it with 64 inputs a request (0.8 MB each; 2 048 took over a minute here, on a busy machine)."""
    texts = [str(i) for i in range(64)]
    for i in range(10):
        attack.send("/v1/embeddings", {"input": texts}, within=30, headers={"Idempotency-Key": f"hostile-{i}"},
                    what=f"embeddings {i + 1}/10 (64 short inputs, Idempotency-Key)")


@case("N8b-the-largest-embedding-answer", llama=True)
def _largest_embedding_answer(attack: Attack, _: Headless) -> None:
    """The most inputs a request may have, answered as lists of numbers: 2 048 of them make 1.2
    million floats, 26 MB of JSON, which one json.dumps call on the loop took 1.3 s to write. Here
    1 024 inputs of a letter each (13 MB), to spare the case a minute of embedding on a busy machine."""
    attack.send("/v1/embeddings", {"input": [chr(97 + i % 26) for i in range(1024)], "encoding_format": "float"},
                within=60, what="1 024 one-letter inputs, answered as floats")


def _open_streams(attack: Attack, task_id: str, count: int, receive_buffer: int | None = None
                  ) -> list[socket.socket]:
    """`count` connections following the task's events, none of which reads."""
    host, port = attack.url.rsplit("/", 1)[-1].rsplit(":", 1)
    opened = []
    request = (f"GET /v1/tasks/{task_id}/events?stream=true HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Authorization: Bearer {attack.token}\r\n\r\n").encode()
    for _ in range(count):
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            if receive_buffer:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            sock.sendall(request)
        except OSError as exc:
            attack.note(f"stream {len(opened) + 1}: {type(exc).__name__}")
            break
        opened.append(sock)
    return opened


def _task_ended(attack: Attack, task_id: str, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        _, text = exchange(attack.url, "GET", f"/v1/tasks/{task_id}",
                           headers={"Authorization": f"Bearer {attack.token}"})
        if json.loads(text).get("status") in ("completed", "failed", "cancelled"):
            return
        time.sleep(0.1)
    attack.bound(False, f"task {task_id} ended within {within:.0f} s")


@case("N7-8MiB-instructions-and-10-streams-that-never-read", llama=True)
def _amplified_streams(attack: Attack, service: Headless) -> None:
    """Every event of the task carried the 8 MiB of instructions (disk), and each stream that does
    not read held a page of them: +74 MiB per stream (red team N7). The streams' own bound is
    5 MiB each; the request's own cost counts in the case's RSS budget."""
    created = attack.send("/v1/responses", {"instructions": "x" * (8 * MIB - 300), "input": "hi",
                                            "max_output_tokens": 1, "background": True},
                          within=10, what="8 MiB of instructions, in the background")
    if created is None or created.status != 202:
        return  # refused: nothing to stream
    task_id = created.body["task"]["id"]
    _task_ended(attack, task_id, 10)
    assert service.proc is not None
    before = rss_kib(service.proc.pid) / 1024
    streams = _open_streams(attack, task_id, 10, receive_buffer=4096)
    peak = before
    for _ in range(50):
        time.sleep(0.1)
        peak = max(peak, rss_kib(service.proc.pid) / 1024)
    for sock in streams:
        sock.close()
    attack.note(f"{len(streams)} streams that never read: RSS {before:.0f} -> {peak:.0f} MiB")
    attack.bound(peak - before <= 50, f"10 unread streams held at most 50 MiB (held {peak - before:.0f} MiB)")


@case("N6-one-app-opens-300-streams", burst=300)
def _all_connections(attack: Attack, _: Headless) -> None:
    """One app's streams on its own running task took every connection (red team N6): /health, the
    owner and a new pairing got connection resets."""
    created = attack.send("/v1/responses", {"input": "Write a very long story about a dragon.", "background": True,
                                            "max_output_tokens": 4000, "temperature": 1},
                          within=5, what="a long story, in the background")
    assert created is not None and created.status == 202, created
    task_id = created.body["task"]["id"]
    streams = _open_streams(attack, task_id, 300)
    attack.note(f"streams opened: {len(streams)}")
    time.sleep(1)
    try:
        attack.send("/health", None, method="GET", token="", within=1, what="/health beside them")
        attack.send("/v1/models", None, method="GET", token=attack.owner, within=1, what="the owner's /v1/models")
        attack.send("/v1/pairings", {"client_name": "Innocent App", "scopes": ["models:read"]}, token="",
                    within=1, expect=202, what="a new pairing request")
    finally:
        for sock in streams:
            sock.close()
        # Its streams were its share of connections: the service must see them closed and free
        # that share soon after, so that the app's own cancel (retried on 429) goes through.
        closed = time.monotonic()
        while (answer := attack.send(f"/v1/tasks/{task_id}/cancel", {}, within=1, what="cancelling the story")) \
                and answer.status == 429 and time.monotonic() - closed < 2:
            time.sleep(0.1)
        attack.bound(answer is not None and answer.status == 200,
                     "the app's cancel went through within 2 s of closing its streams "
                     f"(took {time.monotonic() - closed:.1f} s)")
        _task_ended(attack, task_id, 15)


@case("P7-one-app-holds-every-slot-with-four-long-tasks")
def _every_slot(attack: Attack, _: Headless) -> None:
    """Four background tasks of 4 000 tokens (20 s each here) took every `parallel` slot, and the
    other app's request after the case waited for one of them to end (red team P7: 19 s)."""
    created = [attack.send("/v1/responses", {"input": "Write a very long story.", "max_output_tokens": 4000,
                                             "background": True}, within=5, expect=202, what=f"long task {n + 1}/4")
               for n in range(4)]
    ids = [answer.body["task"]["id"] for answer in created if answer is not None]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the other app comes once every slot is taken
        tasks = [json.loads(exchange(attack.url, "GET", f"/v1/tasks/{task_id}",
                                     headers={"Authorization": f"Bearer {attack.token}"})[1]) for task_id in ids]
        if all(task["slot"] is not None for task in tasks):
            attack.note(f"the four tasks hold slots {sorted(task['slot']['index'] for task in tasks)}")
            return
        time.sleep(0.1)
    attack.bound(False, "the four long tasks held every slot within 10 s")


def _gguf_bomb(path: Path) -> Path:
    """A 1 TiB sparse GGUF (128 MiB on disk) of 32 768 arrays of 2^22 empty strings: each array is
    under the per-array cap, and the file costs ~44 h to walk (red team N10)."""
    arrays, strings = 32_768, 1 << 22
    with path.open("wb") as out:
        out.write(b"GGUF" + struct.pack("<IQQ", 3, 0, arrays))
        for i in range(arrays):
            key = f"k{i}".encode()
            out.write(struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, strings))
            out.seek(strings * 8, 1)
        out.truncate(out.tell())
    return path


@case("N10-one-sparse-gguf-bomb-registration", scopes=MODELER)
def _one_bomb(attack: Attack, _: Headless) -> None:
    bomb = _gguf_bomb(attack.tmp / "bomb.gguf")
    try:
        attack.send("/v1/models", {"path": str(bomb), "id": "bomb"}, within=5, what="registering the sparse bomb")
    finally:
        bomb.unlink()


@case("N10-six-sparse-gguf-bomb-registrations-and-a-pairing", scopes=MODELER)
def _six_bombs(attack: Attack, _: Headless) -> None:
    """Six at once filled the default thread pool: a new pairing got no answer in 30 s."""
    bomb = _gguf_bomb(attack.tmp / "bomb.gguf")
    registrations = [threading.Thread(target=attack.send, args=("/v1/models", {"path": str(bomb), "id": f"bomb{i}"}),
                                       kwargs={"within": 8, "what": f"bomb registration {i + 1}/6"})
                     for i in range(6)]
    try:
        for registration in registrations:
            registration.start()
        time.sleep(2)
        attack.send("/v1/pairings", {"client_name": "Innocent App", "scopes": ["models:read"]}, token="",
                    within=1, patience=10, expect=202, what="a new pairing request beside six registrations")
    finally:
        for registration in registrations:
            registration.join()
        bomb.unlink()


for _name, _run in hostile_tokenless.CASES.items():  # the red team's P3, on the Ollama listener
    case(_name)(_run)


# -- the harness -------------------------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [pytest.param(name, marks=() if spec.llama else pytest.mark.scripted)
                                  for name, spec in CASES.items()])
def test_worst_input_holds_neither_the_loop_nor_the_engine_nor_memory(
        name: str, headless: Headless, procs: Processes, tmp_path: Path) -> None:
    spec = CASES[name]
    headless.start()
    assert headless.proc is not None
    _, bystander = pair_sync(headless.url, headless.token, ["responses:write"], "Bystander")
    _, token = pair_sync(headless.url, headless.token, list(spec.scopes), "Hostile App")
    attack = Attack(headless.url, headless.token, token, tmp_path)
    probe = Probe(procs, headless.url, headless.proc.pid, tmp_path / "lag.txt").start()
    attack.send("/v1/responses", TWO_TOKENS, within=120, token=bystander, what="warm-up (the model loads)")
    idle = attack.send("/v1/responses", TWO_TOKENS, within=30, token=bystander, what="idle 2-token response")
    assert idle is not None and idle.status == 200, attack.figures
    disk, counted = stored_mib(headless.data_dir), counted_mib(headless.data_dir)
    rss = rss_kib(headless.proc.pid) / 1024
    since = time.monotonic()
    try:
        spec.run(attack, headless)
        attack.send("/v1/responses", TWO_TOKENS, within=idle.seconds + ENGINE_BOUND, patience=30, token=bystander,
                    what="after the case, another app's 2-token response")
    finally:
        quiet, lag = probe.stop(since)
    peak = max(lag.peak_rss_mib, rss_kib(headless.proc.pid) / 1024)  # the probe may have had no answer
    grew = stored_mib(headless.data_dir) - disk
    counted = counted_mib(headless.data_dir) - counted
    attack.note(f"{lag}; idle before: {quiet}")
    attack.note(f"RSS {rss:.0f} -> peak {peak:.0f} MiB; DB+WAL +{grew:.1f} MiB, limits counted "
                f"+{counted:.1f} MiB")
    attack.bound(lag.p100 <= spec.lag_bound and not lag.failures,
                 f"/health answered every 50 ms probe within {spec.lag_bound * 1000:.0f} ms "
                 f"(p100 {lag.p100 * 1000:.0f} ms, {lag.failures} unanswered)")
    attack.bound(peak - rss <= RSS_BUDGET, f"RSS grew at most {RSS_BUDGET:.0f} MiB (grew {peak - rss:.0f} MiB)")
    attack.bound(grew <= 2 * counted + DISK_SLACK, f"DB+WAL grew at most 2 x {counted:.1f} + {DISK_SLACK:.0f} MiB "
                 f"(grew {grew:.1f} MiB)")
    print(f"\n{name}:\n  " + "\n  ".join(attack.figures))
    assert not attack.broken, "bounds broken:\n  " + "\n  ".join(attack.broken) + "\nmeasured:\n  " + \
        "\n  ".join(attack.figures)
