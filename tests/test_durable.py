"""Every file the app writes outside SQLite outlasts a power cut (app/durable.py), shown on the
power-cut file system (tests/powercut/): the owner token's file, service.json, a database moved
aside, a downloaded model renamed into place; and `store: false` answers leave the disk at a quit."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from app import durable
from app.core import answers
from app.core.service import AppService
from app.secrets import owner_vault
from app.store import db
from tests import scripted
from tests.conftest import ROOT, Headless, Processes, scripted_app, wait_until

pytestmark = pytest.mark.timeout(60)


def database_bytes(data_dir: Path) -> bytes:
    """lmsp.sqlite3, -wal and -shm as they lie on the disk: what any program of the user reads."""
    return b"".join(p.read_bytes() for p in data_dir.glob("lmsp.sqlite3*"))


def cut_and_remount(powercut: Any) -> Path:
    powercut.cut("drop")
    mnt: Path = powercut.mount().mnt
    return mnt


def test_a_durable_write_is_the_old_file_or_the_new_one_after_a_cut(powercut: Any) -> None:
    mnt = powercut.mount().mnt
    target = mnt / "state" / "service.json"
    durable.write(target, "first")
    mnt = cut_and_remount(powercut)
    assert (mnt / "state" / "service.json").read_text() == "first"
    assert oct((mnt / "state" / "service.json").stat().st_mode & 0o777) == oct(0o600)
    durable.write(mnt / "state" / "service.json", b"second", 0o644)
    # The same steps without the helper's syncs: lost to the cut (the file system is not lenient).
    (mnt / "state" / "plain.json").write_text("written, never synced")
    mnt = cut_and_remount(powercut)
    assert sorted(p.name for p in (mnt / "state").iterdir()) == ["service.json"]  # no temp file left either
    assert (mnt / "state" / "service.json").read_bytes() == b"second"
    durable.remove(mnt / "state" / "service.json")
    assert not (cut_and_remount(powercut) / "state" / "service.json").exists()


def test_the_owner_tokens_file_outlasts_a_cut(powercut: Any) -> None:
    """The keyring's file fallback (conftest selects the "fail" keyring backend)."""
    mnt = powercut.mount().mnt
    assert owner_vault(mnt / "data").put("lmsp_secret") == "file"
    mnt = cut_and_remount(powercut)
    assert owner_vault(mnt / "data").get() == "lmsp_secret"
    assert (mnt / "data" / "owner_token").stat().st_mode & 0o777 == 0o600
    owner_vault(mnt / "data").delete()
    assert owner_vault(cut_and_remount(powercut) / "data").get() is None


def test_a_corrupt_database_moved_aside_stays_aside(powercut: Any) -> None:
    mnt = powercut.mount().mnt
    (mnt / "lmsp.sqlite3").write_bytes(b"not a database")
    durable.sync_dir(mnt)
    fd = os.open(mnt / "lmsp.sqlite3", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    aside = db.move_aside(mnt / "lmsp.sqlite3")
    mnt = cut_and_remount(powercut)
    assert [p.name for p in mnt.iterdir()] == [aside]


@pytest.mark.parametrize("revision", ["main", "refs/pr/1"])
def test_a_downloaded_model_renamed_into_place_stays(powercut: Any, revision: str) -> None:
    """hub.place as the download kind calls it: the blob, its snapshot link and its ref survive,
    the ref with the commit in it (other tools that share the cache read it)."""
    from app.engine.net import hub

    mnt = powercut.mount().mnt
    os.environ["HF_HOME"] = str(mnt / "hf")
    try:
        remote = hub.Remote(repo="o/m", file="m.gguf", revision=revision, commit="0" * 40, sha256="a" * 64,
                            size=5, url="http://127.0.0.1:1/none")
        partial = hub.partial_path(remote, "dl_1")
        partial.parent.mkdir(parents=True)
        durable.write(partial, b"model")  # fetch fsyncs it
        blob = hub.place(remote, partial)
        mnt = cut_and_remount(powercut)
        assert blob.read_bytes() == b"model" and hub.pointer_path(remote).read_bytes() == b"model"
        assert (hub.storage(remote.repo) / "refs" / revision).read_text() == remote.commit
        assert not partial.exists()
    finally:
        del os.environ["HF_HOME"]


async def test_store_false_answers_leave_the_file_when_the_service_stops(tmp_path: Path) -> None:
    """Within the grace period a quit does not leave them behind until the next start."""
    service = AppService(tmp_path / "data", scripted.factory(scripted.Script(pace=1000.0)))
    await service.start()
    try:
        client = await service.access.authenticate(await service.access.owner_token())
        assert client is not None
        secret = "The vault code is 7351-PELICAN."
        ask = answers.Ask(client, {"input": secret, "store": False, "max_output_tokens": 5})
        async with answers.respond(service, ask, lambda: False) as answer:
            assert answer.body["status"] in ("completed", "incomplete")
        unstored = "SELECT count(*) FROM responses WHERE store = 0"
        assert await service.store.read(lambda c: c.execute(unstored).fetchone()[0]) == 1
    finally:
        started = time.time()
        await service.stop()
    assert time.time() - started < 30
    with sqlite3.connect(tmp_path / "data" / "lmsp.sqlite3") as conn:
        assert conn.execute("SELECT count(*) FROM responses WHERE store = 0").fetchone()[0] == 0
    assert b"7351-PELICAN" not in database_bytes(tmp_path / "data")


def test_the_bytes_a_download_continues_from_outlast_a_later_cut(powercut: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed download's bytes, still only in the page cache, are counted as the download's own
    when it continues: a power cut after that must not take them (the soak found digest mismatches)."""
    from app.engine.net import hub

    mnt = powercut.mount().mnt
    partial = mnt / "model.incomplete"
    durable.write(partial, b"")  # its name lasts; its bytes below were never fsynced
    with partial.open("ab") as fh:
        fh.write(b"x" * 10_000)
    monkeypatch.setenv("LMSP_BOOTED_AT", str(time.time() - 60))  # a SIGKILL, no reboot: all there
    assert hub.kept(partial, 0) == 10_000
    assert (cut_and_remount(powercut) / "model.incomplete").read_bytes() == b"x" * 10_000


@pytest.mark.timeout(180)
def test_a_store_false_prompt_leaves_every_database_file_within_two_minutes_while_the_app_runs(
        tmp_path: Path, procs: Processes) -> None:
    """The red team's P10: its rows went after about a minute, but their old pages stayed readable
    in the -wal until a restart (or until writes happened to overwrite them). Apps keep reading."""
    app = Headless(tmp_path / "data", procs, scripted_app(pace=1000.0)).start()
    secret = f"The vault code is {uuid.uuid4().hex}."
    status, answer = app.post("/v1/responses", {"input": secret, "store": False, "max_output_tokens": 5})
    assert status == 200 and answer["status"] in ("completed", "incomplete"), answer
    ended = time.monotonic()
    assert secret.encode() in database_bytes(app.data_dir)

    def gone() -> bool:
        assert app.get("/v1/tasks")[0] == 200  # a reader now and then, as the dashboard is
        return secret.encode() not in database_bytes(app.data_dir)

    wait_until(gone, timeout=120 - (time.monotonic() - ended), interval=1.0, what="the prompt to leave the files")
    print(f"the prompt left the files {time.monotonic() - ended:.0f} s after its answer")
    assert app.get(f"/v1/responses/{answer['id']}")[0] == 404
    assert app.proc is not None and app.proc.poll() is None


def test_store_false_answers_a_start_purged_before_it_was_killed_leave_the_file_at_the_next(
        tmp_path: Path, procs: Processes) -> None:
    """The app SIGKILLed with a `store: false` answer in its WAL; the next start killed right after
    its purge deleted the rows (before it emptied the WAL: done here by a process that commits the
    purge and exits without closing); the start after that finds nothing to purge and must still
    leave no copy in the files (the soak found one)."""
    app = Headless(tmp_path / "data", procs, scripted_app(pace=1000.0)).start()
    secret = "The vault code is 7351-PELICAN."
    status, answer = app.post("/v1/responses", {"input": secret, "store": False, "max_output_tokens": 5})
    assert status == 200 and answer["status"] in ("completed", "incomplete"), answer
    app.kill()
    killed_start = ("import os, sys; from pathlib import Path; from app.store import db; "
                    "from app.tasks import retention; conn = db.connect(Path(sys.argv[1])); "
                    "conn.execute('BEGIN IMMEDIATE'); assert retention.purge_unstored(conn, None, 0) == 1; "
                    "conn.execute('COMMIT'); os._exit(0)")
    subprocess.run([sys.executable, "-c", killed_start, str(app.data_dir / "lmsp.sqlite3")], check=True, cwd=ROOT)
    assert b"7351-PELICAN" in database_bytes(app.data_dir)  # the deleted rows' old copies, in the WAL
    app.start()
    assert b"7351-PELICAN" not in database_bytes(app.data_dir)


def test_a_download_continues_from_its_synced_bytes_after_a_reboot(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed, its bytes on disk are all there (written since the boot: the page cache kept
    them); after a power cut only those a progress commit counted as fsynced are sure."""
    from app.engine.net import hub

    partial = tmp_path / "model.incomplete"
    partial.write_bytes(b"x" * 5000)
    monkeypatch.setenv("LMSP_BOOTED_AT", str(time.time() - 60))
    assert hub.kept(partial, 4096) == 5000
    monkeypatch.setenv("LMSP_BOOTED_AT", str(time.time() + 1))  # booted since it was written
    assert hub.kept(partial, 4096) == 4096
    assert hub.kept(tmp_path / "none.incomplete", 4096) == 0
    monkeypatch.delenv("LMSP_BOOTED_AT")
    assert durable.booted_at() is None or durable.booted_at() < time.time()  # type: ignore[operator]
