"""`lmsp-tray pull owner/name file.gguf [revision]`: download a model through the running service,
with a progress bar. The same file already downloading is followed, not started twice (the
service answers with the task it has); Ctrl-C only stops watching: the download goes on."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from app.cli.client import say

POLL_SECONDS = 0.5
BAR = 30


def bar(progress: dict[str, Any]) -> str:
    done, total = progress.get("bytes") or 0, progress.get("total_bytes") or 0
    share = done / total if total else 0.0
    filled = int(share * BAR)
    rate = progress.get("bytes_per_second")
    speed = f"  {rate / 1e6:6.1f} MB/s  {eta((total - done) / rate)}" if rate and total else ""
    return f"[{'#' * filled}{'.' * (BAR - filled)}] {share:4.0%}  {done / 1e6:,.1f}/{total / 1e6:,.1f} MB{speed}"


def eta(seconds: float) -> str:
    """Time left as `ollama pull` says it: 1h2m, 4m5s, 12s."""
    minutes, secs = divmod(max(int(seconds), 0), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m" if hours else f"{minutes}m{secs}s" if minutes else f"{secs}s"


def pull(call: Callable[..., Any], repo: str, file: str, revision: str | None = None, out: TextIO = sys.stdout) -> int:
    body = {"repo": repo, "file": file, **({"revision": revision} if revision else {})}
    task = call("POST", "/v1/models/downloads", body)
    say(f"{repo}/{file}: task {task['id']}", file=out)
    live = out.isatty()
    shown = ""

    def show(end: str = "") -> None:
        """A terminal redraws one line; a pipe or a log gets one line per percent step."""
        nonlocal shown
        line = bar(task["progress"])
        step = line.split("]")[1][:5]
        if live:
            out.write("\r")  # back to the line's start: the bar redraws itself
            say(line, end=end, file=out, flush=True)
        elif step != shown:
            shown = step
            say(line, file=out, flush=True)

    try:
        while task["status"] not in ("completed", "failed", "cancelled"):
            show()
            time.sleep(POLL_SECONDS)
            task = call("GET", f"/v1/tasks/{task['id']}")
    except KeyboardInterrupt:
        say("\nThe download goes on in LMSP Tray; run the same command to follow it again.", file=out, lines=True)
        return 130
    show(end="\n")  # where it ended: 100% once complete
    if task["status"] == "completed":
        say(f"Ready: model {task['download']['model_id']}", file=out)
        return 0
    error = task.get("error") or {"code": "cancelled", "message": "The download was cancelled."}
    say(f"lmsp-tray: {error['message']} ({error['code']})", file=sys.stderr)
    return 1
