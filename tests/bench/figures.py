"""The figures the benches measured, printed as one table at the end of the run (tests/bench/conftest.py):
the service's beside the bare llama-server's (tests/bench/bare.py) measured in the same test, their
ratio, the bound where one is named, and whether it held. A bench records all its figures first and
then fails on the bounds that did not hold (`hold`), so that one miss hides no other figure."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    what: str
    ours: float
    peer: float | None  # the same measure of the bare server, where there is one
    unit: str
    bound: str = ""  # as the requirement words it
    held: bool | None = None  # None: no bound
    load: float = 0.0  # the machine's 1-minute load average when it was recorded: how busy it was

    @property
    def ratio(self) -> float | None:
        return self.ours / self.peer if self.peer else None


FIGURES: list[Figure] = []


def record(what: str, ours: float, peer: float | None = None, unit: str = "", bound: str = "",
           held: bool | None = None) -> Figure:
    figure = Figure(what, ours, peer, unit, bound, held, os.getloadavg()[0])
    FIGURES.append(figure)
    print(f"[bench] {row(figure)}")
    return figure


def hold(figures: list[Figure]) -> None:
    """Fail on each bound among `figures` that did not hold."""
    missed = [f for f in figures if f.held is False]
    assert not missed, "bounds missed: " + "; ".join(f"{f.what}: {number(f.ours, f.unit)} ({f.bound})"
                                                      for f in missed)


def number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} {unit}" if abs(value) < 10 and unit != "ms" else f"{value:.1f} {unit}"


def row(f: Figure) -> str:
    ratio = "-" if f.ratio is None else f"{f.ratio:.3f}"
    mark = {None: "", True: "held", False: "MISSED"}[f.held]
    return (f"{f.what:<66} | {number(f.ours, f.unit):>14} | {number(f.peer, f.unit):>14} | {ratio:>6} | "
            f"{f.bound:<26} | {mark:<6} | {f.load:>4.1f}")


def table() -> str:
    head = (f"{'figure':<66} | {'LMSP':>14} | {'bare server':>14} | {'ratio':>6} | {'bound':<26} | "
            f"{'':<6} | load")
    return "\n".join([head, "-" * len(head), *map(row, FIGURES)])
