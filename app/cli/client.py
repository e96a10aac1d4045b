"""How the command line reaches the running service, and how it prints what comes back.

The service is found through `service.json` in the data folder and spoken to over HTTP with the
owner token, exactly as any other local app would. Everything the command line prints goes
through `say`: most of it is text the CLI did not write (a model file's metadata and path, names,
the service's and an upstream's error messages, a model's answer), and none of that may drive the
terminal."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPResponse
from pathlib import Path
from typing import Any, TextIO

from app import paths
from app.core.pairing import shown
from app.secrets import owner_vault

TIMEOUT = 30
# A stream waits as long as the service takes: a queue, a model load, a long answer.
STREAM_TIMEOUT: float | None = None
START_IT = "Start it with `lmsp-tray` (the desktop app) or `lmsp-tray serve`."


class CliError(Exception):
    """A failure said in one line on stderr; `code` is the command's exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class NotFound(CliError):
    pass


class Client:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        try:
            self.info = json.loads((data_dir / paths.SERVICE_FILE).read_text())
            self.url = self.info["url"]
        except (OSError, ValueError, KeyError, TypeError):
            raise CliError(f"LMSP Tray is not running (no {paths.SERVICE_FILE} in {data_dir}). {START_IT}") from None
        self.token = owner_vault(data_dir).get()

    def _open(self, method: str, path: str, body: Any, timeout: float | None, stream: bool = False) -> HTTPResponse:
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        if stream:
            headers["Accept"] = "text/event-stream"
        req = urllib.request.Request(self.url + path, method=method, data=data, headers=headers)
        try:
            response: HTTPResponse = urllib.request.urlopen(req, timeout=timeout)
            return response
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read() or b"{}").get("error", {}).get("message")
            except ValueError:
                message = None
            raise (NotFound if err.code == 404 else CliError)(message or f"HTTP {err.code}") from None
        except urllib.error.URLError as err:
            raise CliError(f"LMSP Tray at {self.url} does not answer ({err.reason}). {START_IT}") from None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        with self._open(method, path, body, TIMEOUT) as resp:
            return json.loads(resp.read())

    def stream(self, method: str, path: str, body: Any = None) -> Iterator[dict[str, Any]]:
        """The events of a server-sent event stream, each as it arrives, until the service ends it."""
        with self._open(method, path, body, STREAM_TIMEOUT, stream=True) as resp:
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if line.startswith("data:"):
                    yield json.loads(line[5:])


def printable(text: object, lines: bool = False) -> str:
    """`text` with every control or format character (ESC, BEL, CR, a bidi override) written as a
    visible escape (`\\u001b`): an OSC 52 clipboard write, a title change or a cleared screen in a
    GGUF file's metadata shows as the characters it is. `lines`: newlines and tabs stay (a model's
    answer, the service's log), else they are escaped too (one value must not fake a line of its own)."""
    keep = "\n\t" if lines else ""
    return "".join(c if c in keep else shown(c) for c in str(text))


def say(text: object, *, lines: bool = False, file: TextIO | None = None, end: str = "\n", flush: bool = False
        ) -> None:
    """Print `text` made `printable`: the one way the command line writes to the terminal."""
    print(printable(text, lines), file=file if file is not None else sys.stdout, end=end, flush=flush)


def table(rows: list[list[str]]) -> str:
    """Aligned columns; a cell's control characters are shown escaped, never sent to the terminal."""
    if not rows:
        return ""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def listing(as_json: bool, data: Any, header: list[str], rows: list[list[str]]) -> None:
    """A listing as a table for a person, or (`--json`) the API's own objects for a script."""
    say(json.dumps(data, indent=2) if as_json else table([header, *rows]), lines=True)


def cell(value: Any) -> str:
    """A table cell; "-" for nothing, so that every row splits into the same columns."""
    return "-" if value is None or value == "" else str(value)
