"""Schemas converted to grammars in a process of their own, within a time budget.

llama-cpp-python's converter costs O(n²) to O(n³) on some schemas (900 properties: 37 s): that
belongs neither on the event loop nor in the engine. The worker converts (`grammar.convert`);
schemas that take it longer than BUDGET are refused, and the worker is killed and started again
for the next ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import multiprocessing
import sys
import threading
from collections import OrderedDict
from typing import Any

from app.engine.constraints import grammar
from app.engine.constraints.grammar import Converted
from app.errors import TooManyRequests

if sys.platform == "win32":  # a pipe's end is a PipeConnection there
    from multiprocessing.connection import PipeConnection as Connection
else:
    from multiprocessing.connection import Connection

BUDGET = 2.0  # seconds for one request's schemas
RETRY_AFTER = 3  # seconds: about one budget
KNOWN = 64  # recent results kept (grammars of at most 100,000 characters: a few MB at most)
START_SECONDS = 60.0  # to start the worker (Python, then the converter), not counted in the budget


def _serve(conn: Connection) -> None:
    _name_process(b"lmsp-grammar")
    grammar.convert({"type": "object"})  # load the converter before taking work
    conn.send("ready")
    while True:
        try:
            schemas = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return  # the app went away
        conn.send(grammar.convert_all(schemas))


def _name_process(name: bytes) -> None:
    """The name `ps -o comm` and /proc/<pid>/comm show (Linux), so that it is not taken for an engine."""
    if not sys.platform.startswith("linux"):  # prctl is Linux's (and CDLL(None) is no library on Windows)
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME


class GrammarWorker:
    """Blocking: call `convert` off the event loop. Requests take their turn, one per app at a
    time: an app's next costly schema cannot queue behind its first (429), so one app holds up
    the others for one budget at most. Recent results are kept: apps send the same schema again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()     # the worker: one conversion at a time
        self._guard = threading.Lock()    # what follows
        self._busy: set[str] = set()      # apps with a conversion waiting or running
        self._known: OrderedDict[str, list[Converted]] = OrderedDict()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def convert(self, schemas: list[Any], app: str = "") -> list[Converted]:
        """Each schema's result, up to the first refusal. Over the budget, or if the worker
        dies, the first schema carries the refusal (and is not kept: on a less busy computer it
        may pass). Raises TooManyRequests while `app` has a conversion waiting or running."""
        key = hashlib.sha256(json.dumps(schemas, sort_keys=True).encode()).hexdigest()
        with self._guard:
            if key in self._known:
                self._known.move_to_end(key)
                return self._known[key]
            if app in self._busy:
                raise TooManyRequests("schema_conversion_in_progress", "This app's previous schema is still being "
                                      "converted to a grammar; send the next one when it is answered.", RETRY_AFTER)
            self._busy.add(app)
        try:
            converted, keep = self._converted(schemas)
        finally:
            with self._guard:
                self._busy.discard(app)
        if keep:
            with self._guard:
                self._known[key] = converted
                while len(self._known) > KNOWN:
                    self._known.popitem(last=False)
        return converted

    def _converted(self, schemas: list[Any]) -> tuple[list[Converted], bool]:
        """The worker's answer, and whether it says something of the schemas alone."""
        with self._lock:
            try:
                conn = self._started()
                conn.send(schemas)
                if conn.poll(BUDGET):
                    return list(conn.recv()), True
                reason = f"converting it to a grammar takes longer than {BUDGET:.0f} s"
            except (EOFError, OSError):
                reason = "the grammar converter failed on it"
            self.stop()
            return [(reason, "")], False

    def _started(self) -> Connection:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        self.stop()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs Qt and threads
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs,), name="lmsp-grammar", daemon=True)
        proc.start()
        theirs.close()
        self._proc, self._conn = proc, ours
        if not ours.poll(START_SECONDS) or ours.recv() != "ready":
            raise OSError("the grammar worker did not start")
        return ours

    def stop(self) -> None:
        """End the worker now (also while another thread waits on it: that one sees it die)."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is not None:
            proc.kill()
            proc.join()
        if conn is not None:
            conn.close()
