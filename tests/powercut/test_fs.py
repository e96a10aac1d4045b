"""The power-cut file system loses exactly what a program that did not sync would lose, and keeps
what it synced: file data by fsync of the file, names by fsync of their directory."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)


def write(path: Path, data: bytes, sync: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_cut_keeps_what_was_synced_and_nothing_else(powercut: Any) -> None:
    mnt = powercut.mount().mnt
    write(mnt / "old", b"before")
    write(mnt / "moved", b"to be renamed")
    write(mnt / "gone", b"to be unlinked", sync=True)
    sync_dir(mnt)
    (mnt / "sub").mkdir()
    write(mnt / "sub" / "synced", b"file and folder synced", sync=True)
    sync_dir(mnt / "sub")
    sync_dir(mnt)
    # Not made durable: each of these must be undone by the cut.
    write(mnt / "old", b"overwritten, never synced")
    write(mnt / "data-only", b"file synced, folder not", sync=True)
    write(mnt / "nothing", b"never synced")
    os.rename(mnt / "moved", mnt / "renamed")
    os.unlink(mnt / "gone")
    with (mnt / "sub" / "synced").open("ab") as fh:
        fh.write(b" and an unsynced tail")

    lost = powercut.cut("drop")
    assert lost["ops"] >= 4 and lost["pages"] >= 3
    mnt = powercut.mount().mnt
    assert listing(mnt) == {"old": b"", "moved": b"", "gone": b"to be unlinked"}
    assert listing(mnt / "sub") == {"synced": b"file and folder synced"}


def test_a_rename_lasts_once_its_folder_is_synced(powercut: Any) -> None:
    mnt = powercut.mount().mnt
    write(mnt / "service.json", b"old", sync=True)
    sync_dir(mnt)
    write(mnt / "service.tmp", b"new", sync=True)
    os.replace(mnt / "service.tmp", mnt / "service.json")
    powercut.cut("drop")
    assert listing(powercut.mount().mnt) == {"service.json": b"old"}  # the rename was never synced

    mnt = powercut.mnt
    write(mnt / "service.tmp", b"new", sync=True)
    os.replace(mnt / "service.tmp", mnt / "service.json")
    sync_dir(mnt)
    powercut.cut("drop")
    assert listing(powercut.mount().mnt) == {"service.json": b"new"}


def test_a_torn_cut_keeps_some_later_pages_and_loses_earlier_ones(powercut: Any) -> None:
    """Each page ends old or new, never anything else; over a few cuts some page written later
    survives one written earlier."""
    mnt = powercut.mount().mnt
    pages = 8
    write(mnt / "file", b"o" * 4096 * pages, sync=True)
    sync_dir(mnt)
    later_kept_earlier_lost = False
    for seed in range(6):
        with (mnt / "file").open("r+b") as fh:
            for page in range(pages):  # page 0 first, page 7 last
                fh.seek(page * 4096)
                fh.write(b"n" * 4096)
        powercut.cut("torn", seed)
        mnt = powercut.mount().mnt
        data = (mnt / "file").read_bytes()
        assert len(data) == 4096 * pages
        kept = [data[p * 4096:(p + 1) * 4096] for p in range(pages)]
        assert all(page in (b"o" * 4096, b"n" * 4096) for page in kept)
        flags = [page == b"n" * 4096 for page in kept]
        later_kept_earlier_lost |= any(flags[j] and not flags[i] for i in range(pages) for j in range(i + 1, pages))
        write(mnt / "file", b"o" * 4096 * pages, sync=True)
    assert later_kept_earlier_lost


def test_a_torn_cut_keeps_names_in_order(powercut: Any) -> None:
    """Names are kept as a journal keeps them: a prefix of the unsynced changes, in order."""
    mnt = powercut.mount().mnt
    seen = set()
    for seed in range(8):
        for name in "abcdef":
            write(mnt / name, b"")
        powercut.cut("torn", seed)
        mnt = powercut.mount().mnt
        names = "".join(sorted(p.name for p in mnt.iterdir()))
        assert names == "abcdef"[:len(names)]
        seen.add(len(names))
        for p in mnt.iterdir():
            p.unlink()
        sync_dir(mnt)
    assert len(seen) > 1


@pytest.mark.parametrize("synchronous, kept, modes", [("FULL", list(range(20)), ("drop", "torn")),
                                                      ("OFF", None, ("drop",))])
def test_sqlite_keeps_its_commits_only_when_it_syncs_them(powercut: Any, synchronous: str, kept: Any,
                                                          modes: tuple[str, ...]) -> None:
    """SQLite in WAL mode: with synchronous=FULL every commit survives a cut, in both modes; with
    OFF (no fsync) a dropping cut loses them: the file system does drop what is not synced."""
    for mode in modes:
        mnt = powercut.mount().mnt
        (mnt / "db.sqlite3").unlink(missing_ok=True)
        for suffix in ("-wal", "-shm"):
            (mnt / f"db.sqlite3{suffix}").unlink(missing_ok=True)
        sync_dir(mnt)
        conn = sqlite3.connect(mnt / "db.sqlite3", isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("CREATE TABLE t (n INTEGER)")
        for n in range(20):
            conn.execute("INSERT INTO t VALUES (?)", (n,))
        powercut.cut_power(mode, seed=7)
        conn.close()  # (it may not write to the mount any more)
        powercut.unmount()
        mnt = powercut.mount().mnt
        if kept is None:
            with pytest.raises(sqlite3.OperationalError):  # not even its table was kept
                sqlite3.connect(mnt / "db.sqlite3").execute("SELECT n FROM t").fetchall()
            powercut.unmount()
            continue
        check = sqlite3.connect(mnt / "db.sqlite3")
        assert check.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert [n for (n,) in check.execute("SELECT n FROM t ORDER BY n")] == kept
        check.close()
        powercut.unmount()
