"""Pairing (LMSP §3): a local app asks, the owner approves or denies, the app collects a scoped
token exactly once; tokens are scoped, clients isolated, revocable, and never stored in clear.
Also the CLI (`pairings`, `token`, `status`, `models`, `tasks`) against a real headless service."""

from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from app.core import pairing
from app.errors import LmspError
from app.server import peer
from tests.conftest import ROOT
from tests.helpers import SAY_HI, bearer, check_error, expect_error, http, pair, raw

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

ALL_SCOPES = ["models:read", "models:write", "responses:read", "responses:write", "tasks:read",
              "tasks:cancel", "metrics:read", "admin"]
WORKER = ["responses:read", "responses:write", "tasks:read", "tasks:cancel"]


async def request_pairing(api: Any, name: str = "Editor", scopes: list[str] | None = None) -> dict[str, Any]:
    resp, text = await raw(api, "POST", "/v1/pairings", json={"client_name": name, "scopes": scopes or WORKER})
    assert resp.status == 202, text
    return json.loads(text)


async def status_of(api: Any, pairing_id: str) -> dict[str, Any]:
    resp, text = await raw(api, "GET", f"/v1/pairings/{pairing_id}")
    assert resp.status == 200, text
    return json.loads(text)


async def pairings_count(service: Any) -> int:
    return await service.store.read(lambda c: c.execute("SELECT count(*) FROM pairings").fetchone()[0])


# -- the request and its states ---------------------------------------------------------------

async def test_request_is_pending_with_unguessable_id_and_code(api):
    before = time.time()
    created = await request_pairing(api, "Editor", ["responses:write", "responses:read"])
    assert created["status"] == "pending"
    assert created["id"].startswith("pair_")
    random_part = created["id"][len("pair_"):]
    assert re.fullmatch(r"[A-Za-z0-9_-]+", random_part)
    assert len(random_part) * 6 >= 128, created["id"]  # base64url: 6 bits a character
    assert re.fullmatch(r"\d{3}-\d{3}", created["code"]), created["code"]
    assert before + 60 < created["expires_at"] <= time.time() + 301
    assert created["client_name"] == "Editor"
    assert sorted(created["scopes"]) == ["responses:read", "responses:write"]
    assert "token" not in created

    shown = await status_of(api, created["id"])
    assert shown["status"] == "pending" and "token" not in shown
    assert shown["code"] == created["code"]
    # The owner sees it waiting (the desktop app's list and `lmsp-tray pairings`).
    resp = await api.get("/v1/pairings")
    assert resp.status == 200
    assert created["id"] in [p["id"] for p in (await resp.json())["data"]]
    # Two requests never share an id.
    other = await request_pairing(api, "Another editor")
    assert other["id"] != created["id"]


async def test_approve_hands_the_token_over_exactly_once(api, service):
    created = await request_pairing(api, "Notes", ["responses:read"])
    resp = await api.post(f"/v1/pairings/{created['id']}/approve")
    assert resp.status == 200, await resp.text()
    decided = await resp.json()
    assert decided["status"] == "approved" and "token" not in decided  # only the requester gets it
    assert decided["client_id"]

    first = await status_of(api, created["id"])
    assert first["status"] == "approved"
    token = first["token"]
    assert token.startswith("lmsp_") and len(token) >= len("lmsp_") + 43  # 256 bits, base64url
    second = await status_of(api, created["id"])
    assert second["status"] == "approved" and "token" not in second
    third = await status_of(api, created["id"])
    assert "token" not in third

    # The token is a working credential of the new client, listed by the owner.
    resp, text = await raw(api, "GET", "/v1/responses/resp_nothing", headers=bearer(token))
    check_error(resp.status, text, 404, "not_found")
    resp = await api.get("/v1/clients")
    clients = {c["id"]: c for c in (await resp.json())["data"]}
    assert clients[first["client_id"]]["name"] == "Notes"
    assert clients[first["client_id"]]["scopes"] == ["responses:read"]
    assert clients[first["client_id"]]["owner"] is False

    # Deciding again is a conflict.
    for verb in ("approve", "deny"):
        await expect_error(await api.post(f"/v1/pairings/{created['id']}/{verb}"), 409, "pairing_not_pending")


async def test_deny_gives_no_token_and_cannot_be_approved_afterwards(api, service):
    created = await request_pairing(api)
    clients_before = await service.store.read(lambda c: c.execute("SELECT count(*) FROM clients").fetchone()[0])
    resp = await api.post(f"/v1/pairings/{created['id']}/deny")
    assert resp.status == 200 and (await resp.json())["status"] == "denied"
    for _ in range(2):
        shown = await status_of(api, created["id"])
        assert shown["status"] == "denied" and "token" not in shown
    await expect_error(await api.post(f"/v1/pairings/{created['id']}/approve"), 409, "pairing_not_pending")
    assert (await status_of(api, created["id"]))["status"] == "denied"
    assert await service.store.read(lambda c: c.execute("SELECT count(*) FROM clients").fetchone()[0]) \
        == clients_before


async def test_expired_request_cannot_be_approved(api, service):
    created = await request_pairing(api)
    await service.store.write(lambda c: c.execute("UPDATE pairings SET expires_at = ? WHERE id = ?",
                                                  (time.time() - 1, created["id"])))
    shown = await status_of(api, created["id"])
    assert shown["status"] == "expired" and "token" not in shown
    await expect_error(await api.post(f"/v1/pairings/{created['id']}/approve"), 409, "pairing_not_pending")
    await expect_error(await api.post(f"/v1/pairings/{created['id']}/deny"), 409, "pairing_not_pending")
    assert (await status_of(api, created["id"]))["status"] == "expired"
    resp = await api.get("/v1/pairings")
    assert created["id"] not in [p["id"] for p in (await resp.json())["data"]]


async def test_each_requester_has_its_own_share_of_waiting_requests(api, service):
    """Another local user (told apart by the socket's owner, app/server/peer.py) fills its share
    and asks again and again: the owner's apps can still pair. One waiting request per name."""
    for i in range(pairing.MAX_PENDING_PER_REQUESTER):
        await service.access.request_pairing({"client_name": f"Flood {i}", "scopes": WORKER}, requester="uid:4242")
    with pytest.raises(LmspError) as refused:
        await service.access.request_pairing({"client_name": "Flood more", "scopes": WORKER}, requester="uid:4242")
    assert refused.value.status == 429 and refused.value.code == "too_many_pairings"
    created = await request_pairing(api, "Real app")  # through the API, from this test's own user
    resp, text = await raw(api, "POST", "/v1/pairings", json={"client_name": "Real app", "scopes": WORKER})
    check_error(resp.status, text, 429, "too_many_pairings")  # its first request is still waiting
    assert 0 < int(resp.headers["Retry-After"]) <= created["expires_at"] - created["created_at"] + 1  # when it expires
    approved = await api.post(f"/v1/pairings/{created['id']}/approve")
    assert approved.status == 200, await approved.text()
    assert (await status_of(api, created["id"]))["token"].startswith("lmsp_")
    # Answered (or expired) requests no longer count.
    await request_pairing(api, "Real app")


def test_the_user_at_the_other_end_of_a_loopback_connection_is_known() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            uid = peer.loopback_uid(client.getsockname()[1], server.getsockname()[1])
    assert uid == os.getuid()


async def test_unknown_pairing_is_404(api):
    resp, text = await raw(api, "GET", "/v1/pairings/pair_doesnotexist")
    check_error(resp.status, text, 404, "not_found")
    await expect_error(await api.post("/v1/pairings/pair_doesnotexist/approve"), 404, "not_found")


@pytest.mark.parametrize("body, param", [
    ({"scopes": ["responses:read"]}, "client_name"),
    ({"client_name": "", "scopes": ["responses:read"]}, "client_name"),
    ({"client_name": 7, "scopes": ["responses:read"]}, "client_name"),
    ({"client_name": "x" * 101, "scopes": ["responses:read"]}, "client_name"),
    ({"client_name": "App"}, "scopes"),
    ({"client_name": "App", "scopes": []}, "scopes"),
    ({"client_name": "App", "scopes": ["responses:read", "root"]}, "scopes"),
    ({"client_name": "App", "scopes": "responses:read"}, "scopes"),
    ({"client_name": "App", "scopes": {"responses:read": True}}, "scopes"),
    ({"client_name": "App", "scopes": [1]}, "scopes"),
    ({"client_name": "App", "scopes": ["responses:read"], "callback": "http://x"}, "callback"),
])
async def test_invalid_pairing_bodies_are_400_naming_the_field(api, service, body, param):
    before = await pairings_count(service)
    resp, text = await raw(api, "POST", "/v1/pairings", json=body)
    check_error(resp.status, text, 400, "invalid_request", param)
    assert await pairings_count(service) == before


@pytest.mark.parametrize("name", ["Evil\x1b[2J\x1b[H", "Bell\x07", "Nul\x00", "Two\nlines", "Back\rspace",
                                  "Line\u2028sep", "Para\u2029sep", "\u202eppA lanimreT", "Iso\u2066late",
                                  "Zero\u200bwidth", "Del\x7f", "C1\x9b31m"])
async def test_control_and_format_characters_in_a_name_are_400(api, service, name):
    """A name is shown in a terminal, the tray and notifications: nothing in it may redraw or
    reorder what the owner sees (a fake row, a hidden `admin`)."""
    resp, text = await raw(api, "POST", "/v1/pairings", json={"client_name": name, "scopes": WORKER})
    check_error(resp.status, text, 400, "invalid_request", "client_name")
    assert await pairings_count(service) == 0
    await request_pairing(api, "Éditeur 文字 ✓")  # ordinary letters and symbols of any script still pass


# The red team's row: a fake code and scope, then the real ones pushed some 90 columns right.
SPOOF = "Notes" + "\u3000" * 22 + " 123-456  models:read" + "\u3000" * 22


@pytest.mark.parametrize("name", [SPOOF, "No\u00a0break", "Em\u2003space", "Thin\u2009space", "Hangul\u3164filler",
                                  "Braille\u2800blank", "Za\u0301\u0302\u0303\u0304lgo"])
async def test_blanks_other_than_the_space_and_stacked_accents_in_a_name_are_400(api, service, name):
    """Wide or invisible blanks, and piles of combining marks, let a name pad or overdraw the row
    that shows it, so that a fake code and scope stand where the real ones should."""
    resp, text = await raw(api, "POST", "/v1/pairings", json={"client_name": name, "scopes": WORKER})
    err = check_error(resp.status, text, 400, "invalid_request", "client_name")
    assert "space" in err["message"]
    assert await pairings_count(service) == 0
    # Ordinary spaces, and the accents of real words (Vietnamese stacks two), still pass.
    await request_pairing(api, "Nguye\u0302\u0303n's  notes")


async def test_pairing_body_must_be_a_json_object(api, service):
    resp, text = await raw(api, "POST", "/v1/pairings", json=["responses:read"])
    check_error(resp.status, text, 400, "invalid_request")
    resp, text = await raw(api, "POST", "/v1/pairings", data=b"{not json",
                           headers={"Content-Type": "application/json"})
    check_error(resp.status, text, 400, "invalid_json")
    assert await pairings_count(service) == 0


# -- what a paired token may do -----------------------------------------------------------------

async def test_token_works_for_its_scopes_only(api):
    _, token = await pair(api, ["responses:read", "responses:write"])
    resp, text = await raw(api, "POST", "/v1/responses", headers=bearer(token), json=SAY_HI)
    assert resp.status == 200, text
    mine = json.loads(text)
    resp, text = await raw(api, "GET", f"/v1/responses/{mine['id']}", headers=bearer(token))
    assert resp.status == 200 and json.loads(text)["output_text"] == mine["output_text"]

    outside = [("GET", "/v1/models"), ("POST", "/v1/models"), ("GET", "/v1/tasks"),
               ("GET", f"/v1/tasks/{mine['task']['id']}"), ("POST", f"/v1/tasks/{mine['task']['id']}/cancel"),
               ("GET", "/v1/settings"), ("PATCH", "/v1/settings"), ("GET", "/v1/clients"),
               ("DELETE", "/v1/clients/client_owner"), ("GET", "/v1/pairings"),
               ("POST", "/v1/pairings/pair_x/approve"), ("GET", "/metrics")]
    for method, path in outside:
        resp, text = await raw(api, method, path, headers=bearer(token), json={})
        err = check_error(resp.status, text, 403, "insufficient_scope")
        assert err["type"] == "permission_error", (method, path)


async def test_paired_clients_see_only_their_own_work(api, service):
    service.tasks.set_paused(True)  # the tasks only have to exist (queued, with their opening events)
    alice_id, alice = await pair(api, WORKER, "Alice")
    bob_id, bob = await pair(api, WORKER, "Bob")
    owned: dict[str, dict[str, Any]] = {}
    background = {**SAY_HI, "background": True}
    for who, token in (("alice", alice), ("bob", bob)):
        resp, text = await raw(api, "POST", "/v1/responses", headers=bearer(token), json=background)
        assert resp.status == 202, text
        owned[who] = json.loads(text)
    resp = await api.post("/v1/responses", json=background)
    owned["owner"] = await resp.json()

    a_resp, a_task = owned["alice"]["id"], owned["alice"]["task"]["id"]
    for method, path in [("GET", f"/v1/responses/{a_resp}"), ("GET", f"/v1/responses/{a_resp}?stream=true"),
                         ("POST", f"/v1/responses/{a_resp}/cancel"), ("DELETE", f"/v1/responses/{a_resp}"),
                         ("GET", f"/v1/tasks/{a_task}"), ("GET", f"/v1/tasks/{a_task}/events"),
                         ("GET", f"/v1/tasks/{a_task}/events?stream=true"),
                         ("POST", f"/v1/tasks/{a_task}/cancel")]:
        resp, text = await raw(api, method, path, headers=bearer(bob))
        err = check_error(resp.status, text, 404, "not_found")
        assert "Alice" not in err["message"], err
    # The owner's work is just as invisible to a client.
    resp, text = await raw(api, "GET", f"/v1/responses/{owned['owner']['id']}", headers=bearer(bob))
    check_error(resp.status, text, 404, "not_found")
    # Paging after another's task answers exactly as after one that does not exist (no oracle).
    unknown, unknown_text = await raw(api, "GET", "/v1/tasks?after=task_doesnotexist", headers=bearer(bob))
    theirs, theirs_text = await raw(api, "GET", f"/v1/tasks?after={a_task}", headers=bearer(bob))
    assert theirs.status == unknown.status == 400, theirs_text
    assert json.loads(theirs_text)["error"]["message"].replace(a_task, "X") == \
        json.loads(unknown_text)["error"]["message"].replace("task_doesnotexist", "X")

    # Each client lists only its own tasks; the owner (admin) lists all.
    for who, token in (("alice", alice), ("bob", bob)):
        resp, text = await raw(api, "GET", "/v1/tasks", headers=bearer(token))
        assert resp.status == 200, text
        assert [t["id"] for t in json.loads(text)["data"]] == [owned[who]["task"]["id"]]
        resp, text = await raw(api, "GET", f"/v1/tasks/{owned[who]['task']['id']}/events", headers=bearer(token))
        assert resp.status == 200 and json.loads(text)["data"], text
    resp = await api.get("/v1/tasks")
    assert {t["id"] for t in (await resp.json())["data"]} == {o["task"]["id"] for o in owned.values()}
    for o in owned.values():
        assert (await api.get(f"/v1/responses/{o['id']}")).status == 200
    # Bob's attempts to cancel and delete Alice's response did nothing.
    resp, text = await raw(api, "GET", f"/v1/responses/{a_resp}", headers=bearer(alice))
    assert resp.status == 200 and json.loads(text)["status"] == "queued", text
    assert {alice_id, bob_id} <= {c["id"] for c in (await (await api.get("/v1/clients")).json())["data"]}


async def test_revoked_client_is_refused_on_its_next_request(api):
    client_id, token = await pair(api, WORKER)
    resp, text = await raw(api, "GET", "/v1/tasks", headers=bearer(token))
    assert resp.status == 200, text
    resp = await api.delete(f"/v1/clients/{client_id}")
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["deleted"] is True
    resp, text = await raw(api, "GET", "/v1/tasks", headers=bearer(token))
    check_error(resp.status, text, 401, "unauthorized")
    resp, text = await raw(api, "POST", "/v1/responses", headers=bearer(token), json=SAY_HI)
    check_error(resp.status, text, 401, "unauthorized")
    clients = (await (await api.get("/v1/clients")).json())["data"]
    assert client_id not in [c["id"] for c in clients]
    await expect_error(await api.delete(f"/v1/clients/{client_id}"), 404, "not_found")
    await expect_error(await api.delete("/v1/clients/client_nobody"), 404, "not_found")


async def test_the_owner_cannot_be_revoked(api):
    clients = (await (await api.get("/v1/clients")).json())["data"]
    owner = [c for c in clients if c["owner"]]
    assert len(owner) == 1 and owner[0]["scopes"] == ["admin"]
    await expect_error(await api.delete(f"/v1/clients/{owner[0]['id']}"), 409, "cannot_revoke_owner")
    assert (await api.get("/v1/clients")).status == 200  # the owner token still works


async def test_tokens_never_reach_the_database_file(api, service):
    service.tasks.set_paused(True)  # a stored request made with the token is enough; no generation needed
    client_id, token = await pair(api, WORKER, "Secretive")
    resp, text = await raw(api, "POST", "/v1/responses", headers=bearer(token), json={**SAY_HI, "background": True})
    assert resp.status == 202, text
    resp, text = await raw(api, "GET", "/v1/tasks", headers=bearer(token))
    assert resp.status == 200
    # The hash is what is stored (and is what authenticates).
    stored = await service.store.read(lambda c: c.execute("SELECT token_hash FROM clients WHERE id = ?",
                                                          (client_id,)).fetchone()[0])
    assert len(stored) == 64 and token not in stored
    db = Path(service.store.path)
    files = [p for p in (db, Path(f"{db}-wal")) if p.exists()]
    assert files
    secret, owner_secret = token.encode(), api.token.encode()
    random_part = token[len("lmsp_"):].encode()
    for f in files:
        data = f.read_bytes()
        assert secret not in data and random_part not in data, f
        assert owner_secret not in data, f


# -- the CLI against a real service ------------------------------------------------------------

def cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", "--data-dir", str(data_dir), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_pairings_token_status_models_tasks(headless):
    headless.start()
    data_dir = headless.data_dir

    done = cli(data_dir, "pairings")
    assert done.returncode == 0, done.stderr
    assert "No pairing requests are waiting." in done.stdout

    status, created = http(f"{headless.url}/v1/pairings", "POST",
                           {"client_name": "Shell Script", "scopes": ["responses:read", "tasks:read"]})
    assert status == 202, created
    done = cli(data_dir, "pairings")
    assert done.returncode == 0, done.stderr
    assert created["id"] in done.stdout and created["code"] in done.stdout and "Shell Script" in done.stdout
    assert "responses:read" in done.stdout

    done = cli(data_dir, "pairings", "approve", created["id"])
    assert done.returncode == 0, done.stderr
    assert "Shell Script: approved" in done.stdout
    status, shown = http(f"{headless.url}/v1/pairings/{created['id']}")
    assert status == 200 and shown["token"].startswith("lmsp_"), shown
    status, body = http(f"{headless.url}/v1/tasks", token=shown["token"])
    assert status == 200 and body["data"] == []
    assert "No pairing requests are waiting." in cli(data_dir, "pairings").stdout

    status, other = http(f"{headless.url}/v1/pairings", "POST", {"client_name": "Spy", "scopes": ["admin"]})
    done = cli(data_dir, "pairings", "deny", other["id"])
    assert done.returncode == 0 and "Spy: denied" in done.stdout, (done.stdout, done.stderr)
    done = cli(data_dir, "pairings", "approve", other["id"])
    assert done.returncode != 0 and "denied" in done.stderr, (done.stdout, done.stderr)

    done = cli(data_dir, "token")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == headless.token

    done = cli(data_dir, "status")
    assert done.returncode == 0, done.stderr
    assert headless.url in done.stdout and "0 running, 0 queued" in done.stdout

    # A remote model (here this same service as its upstream) is listed too: it has no file.
    status, body = headless.post("/v1/models", {"id": "far-away", "remote": {"endpoints": [
        {"base_url": f"{headless.url}/v1", "model": "smollm2-135m-instruct", "api_key": headless.token}]}})
    assert status == 201, body
    done = cli(data_dir, "models")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "SIZE", "DIGEST"]
    local = next(line for line in lines[1:] if line.startswith("smollm2-135m-instruct"))
    assert "sha256:" in local and "MB" in local, done.stdout
    assert next(line for line in lines[1:] if line.startswith("far-away")).split()[2] == "remote", done.stdout

    status, response = headless.post("/v1/responses", SAY_HI)
    assert status == 200, response
    done = cli(data_dir, "tasks")
    assert done.returncode == 0, done.stderr
    row = [line for line in done.stdout.splitlines() if line.startswith(response["task"]["id"])]
    assert row and "completed" in row[0] and "smollm2-135m-instruct" in row[0], done.stdout

    assert headless.terminate() == 0
    done = cli(data_dir, "status")
    assert done.returncode == 1 and "not running" in done.stderr, (done.stdout, done.stderr)
    assert cli(data_dir, "token").stdout.strip() == headless.token  # needs no running service


def shown_pairings(headless, name: str, code: str) -> str:
    """What `lmsp-tray pairings` prints for an `admin` pairing request stored with `name` as it is
    (stored before names were checked, or written by anything else)."""
    headless.start()
    with sqlite3.connect(headless.data_dir / "lmsp.sqlite3") as conn:
        conn.execute("INSERT INTO pairings(id, client_name, scopes, code, status, created_at, expires_at) "
                     "VALUES ('pair_old', ?, '[\"admin\"]', ?, 'pending', ?, ?)",
                     (name, code, time.time(), time.time() + 300))
    done = cli(headless.data_dir, "pairings")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cli_shows_control_characters_escaped(headless):
    """Even such a name cannot drive the owner's terminal: its control characters are printed as escapes."""
    stdout = shown_pairings(headless, "Editor\x1b[1A\x1b[2K\rFake  123-456  models:read\u202e\x07", "111-222")
    assert not any(unicodedata.category(c) in ("Cc", "Cf") for c in stdout.replace("\n", "")), stdout
    assert "Editor\\u001b[1A\\u001b[2K\\u000dFake" in stdout and "\\u202e\\u0007" in stdout
    row = next(line for line in stdout.splitlines() if "pair_old" in line)
    assert "111-222" in row and "admin" in row  # the real code and scope stay on the row, visible


def test_cli_shows_the_code_and_scopes_before_the_app_name(headless):
    """Whatever a name holds, the row shows the real code and scopes first: the name, last,
    cannot push them off a terminal's line."""
    header, row = shown_pairings(headless, SPOOF, "497-851").splitlines()
    assert header.split() == ["ID", "CODE", "SCOPES", "APP"]
    assert row.index("497-851") < row.index("admin") < row.index("123-456"), row
    assert row.index("admin") < 40, row  # on any terminal's first line
