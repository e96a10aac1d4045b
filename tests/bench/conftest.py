"""The benches' table of figures (tests/bench/figures.py), printed once every bench has run."""

from __future__ import annotations

import os
from typing import Any

from tests.bench import figures


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not figures.FIGURES:
        return
    terminalreporter.section("bench figures")
    terminalreporter.write_line(f"{os.cpu_count()} cores; load average now {os.getloadavg()[0]:.2f} "
                                "(the load column: when each figure was recorded)")
    for line in figures.table().splitlines():
        terminalreporter.write_line(line)
