"""`python -m tests.bench.threads_app <threads> --headless ...`: the app as `python -m app` runs it,
but every engine runs llama.cpp on `<threads>` threads instead of the pool's share of the cores,
so that a bench compares it with a bare llama-server on as many (tests/bench/bare.py). The engines
are the app's own, made by the composition root's factory, as tests/scripted_app.py swaps them."""

import functools
import sys
from typing import Any

from app import main
from app.engine.parent.engine import Engine
from app.engine.parent.modes import EngineModes


def engines(threads: int) -> Any:
    """The pool's factory, `n_threads` fixed at `threads` whatever share of the cores it offers."""
    def make(name: str, modes: EngineModes, n_threads: int | None = None) -> Engine:
        return Engine(name, modes, n_threads=threads)
    return make


if __name__ == "__main__":
    threads = int(sys.argv.pop(1))
    main.AppService = functools.partial(main.AppService, engine_factory=engines(threads))  # type: ignore[misc]
    raise SystemExit(main.main())
