"""`lmsp-tray pull owner/name file.gguf [revision]`: download a model through the running service,
with a progress bar. The same file already downloading is followed, not started twice (the
service answers with the task it has); Ctrl-C only stops watching: the download goes on."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

POLL_SECONDS = 0.5
BAR = 30


def bar(progress: dict[str, Any]) -> str:
    done, total = progress.get("bytes") or 0, progress.get("total_bytes") or 0
    share = done / total if total else 0.0
    filled = int(share * BAR)
    rate = progress.get("bytes_per_second")
    speed = f"  {rate / 1e6:6.1f} MB/s" if rate else ""
    return f"[{'#' * filled}{'.' * (BAR - filled)}] {share:4.0%}  {done / 1e6:,.1f}/{total / 1e6:,.1f} MB{speed}"


def pull(call: Callable[..., Any], args: list[str], out: TextIO = sys.stdout) -> int:
    if len(args) not in (2, 3):
        print("usage: lmsp-tray pull owner/name file.gguf [revision]", file=sys.stderr)
        return 2
    body = {"repo": args[0], "file": args[1], **({"revision": args[2]} if len(args) == 3 else {})}
    task = call("POST", "/v1/models/downloads", body)
    print(f"{args[0]}/{args[1]}: task {task['id']}", file=out)
    live = out.isatty()
    shown = ""

    def show(end: str = "") -> None:
        """A terminal redraws one line; a pipe or a log gets one line per percent step."""
        nonlocal shown
        line = bar(task["progress"])
        step = line.split("]")[1][:5]
        if live:
            print(f"\r{line}", end=end, file=out, flush=True)
        elif step != shown:
            shown = step
            print(line, file=out, flush=True)

    try:
        while task["status"] not in ("completed", "failed", "cancelled"):
            show()
            time.sleep(POLL_SECONDS)
            task = call("GET", f"/v1/tasks/{task['id']}")
    except KeyboardInterrupt:
        print("\nThe download goes on in LMSP Tray; run the same command to follow it again.", file=out)
        return 130
    show(end="\n")  # where it ended: 100% once complete
    if task["status"] == "completed":
        print(f"Ready: model {task['download']['model_id']}", file=out)
        return 0
    error = task.get("error") or {"code": "cancelled", "message": "The download was cancelled."}
    print(f"lmsp-tray: {error['message']} ({error['code']})", file=sys.stderr)
    return 1
