"""The start checks the database (`PRAGMA quick_check`, which reads the whole file) only when the
last run did not close it cleanly: a quit records the clean close in the file, and every start
deletes that record, durably, before it serves anything. A SIGKILL, a crash or a power cut in a
later run therefore leaves no record, and the next start checks (a corrupt file is moved aside)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from app.store import config, db
from app.store.store import Store
from tests.conftest import Headless, Processes, scripted_app
from tests.test_store import _garble_middle, siblings

pytestmark = pytest.mark.timeout(120)
CHECKED = "database checked after an unclean end"
SKIPPED = "database closed cleanly by the last run: not checked"


async def test_a_clean_close_lets_the_next_open_skip_the_check_and_only_that_one(tmp_path: Path) -> None:
    path = tmp_path / "lmsp.sqlite3"
    store = Store(path)
    await store.open()
    await store.write(config.save, {"kept": 1})
    await store.close()

    opened = db.open_database(path)
    assert not opened.checked
    assert config.get_value(opened.conn, "kept") == 1
    assert config.get_value(opened.conn, db.CLOSED_CLEANLY) is None  # gone as the start began
    opened.conn.close()  # no clean close: as a crash leaves it

    again = db.open_database(path)
    assert again.checked
    again.conn.close()


def starts(app: Headless) -> list[str]:
    """What each start so far said about the database, in order."""
    return [line for line in app.log.read_text().splitlines() if CHECKED in line or SKIPPED in line]


def test_a_quit_skips_the_next_starts_check_and_a_sigkill_does_not(tmp_path: Path, procs: Processes) -> None:
    app = Headless(tmp_path / "data", procs, scripted_app(pace=1000.0))
    app.start()
    app.complete({"input": "Hello.", "max_output_tokens": 3})
    assert app.terminate() == 0
    app.start()
    assert SKIPPED in starts(app)[-1]
    app.kill()
    app.start()
    assert CHECKED in starts(app)[-1]
    # A file damaged while no clean close was recorded is caught, and moved aside as ever.
    app.kill()
    _garble_middle(app.data_dir / "lmsp.sqlite3")
    app.start()
    assert CHECKED in starts(app)[-1]
    aside = app.get("/lmsp")[1]["recovered_from_corruption"]
    assert siblings(app.data_dir / "lmsp.sqlite3", "corrupt")[0].name == aside
    assert app.terminate() == 0


def test_a_power_cut_in_the_run_after_a_clean_quit_leaves_the_next_start_checking(powercut: Any,
                                                                                   procs: Processes) -> None:
    """The record of a clean quit outlasts a cut while the app is not running (it is fsynced
    before the quit ends); the next start deletes it before it serves, so a cut during that run
    leaves none behind."""
    mnt = powercut.mount().mnt
    env = {**os.environ, "LMSP_BOOTED_AT": "0", "HF_HOME": str(mnt / "models")}
    app = Headless(mnt / "data", procs, scripted_app(pace=1000.0), env=env)
    app.log = mnt.parent / "app.log"  # beside the mount: it outlasts the cut
    app.start()
    app.complete({"input": "Hello.", "max_output_tokens": 3})
    assert app.terminate() == 0
    powercut.cut("drop")
    mnt = powercut.mount().mnt
    opened = db.open_database(mnt / "data" / "lmsp.sqlite3")  # as the next start would
    assert not opened.checked
    opened.conn.close()  # and that start's record deleted, it crashes (no clean close)
    # Again through the app: a clean quit, a start, then the power cut while it runs.
    app.start()
    assert app.terminate() == 0
    app.start()
    app.complete({"input": "Hello again.", "max_output_tokens": 3})
    powercut.cut_power("drop")
    app.kill()
    powercut.unmount()
    mnt = powercut.mount().mnt
    opened = db.open_database(mnt / "data" / "lmsp.sqlite3")
    assert opened.checked
    assert opened.recovered_from_corruption is None
    opened.conn.close()
