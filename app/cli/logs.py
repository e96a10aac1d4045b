"""`lmsp-tray logs [-f] [TASK]`: a task's events, or the service's log file, and (`-f`) what
comes next as it comes."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app import logs, paths
from app.cli.client import Client, CliError, say

PAGE = 1000  # events GET /v1/tasks/{id}/events answers at most at once
POLL_SECONDS = 0.25


def task_log(client: Client, args: argparse.Namespace) -> int:
    events: Iterable[dict[str, Any]] = (
        client.stream("GET", f"/v1/tasks/{args.task}/events?stream=true") if args.follow
        else stored_events(client, args.task))
    try:
        for event in events:
            say(json.dumps(event) if args.json else event_line(event), flush=True)
    except KeyboardInterrupt:  # only stops watching
        return 130
    return 0


def stored_events(client: Client, task_id: str) -> Iterable[dict[str, Any]]:
    after = -1
    while True:
        page = client.call("GET", f"/v1/tasks/{task_id}/events?after={after}")["data"]
        yield from page
        if len(page) < PAGE:
            return
        after = page[-1]["sequence_number"]


def event_line(event: dict[str, Any]) -> str:
    stamp = float(event.get("created_at") or 0.0)
    clock = time.strftime("%H:%M:%S", time.localtime(stamp)) + f".{int(stamp % 1 * 1000):03d}"
    return f"{clock}  {event['type']}  {_detail(event)}".rstrip()


def _detail(event: dict[str, Any]) -> str:
    if "delta" in event:
        return json.dumps(event["delta"], ensure_ascii=False)
    if event.get("error"):
        return str(event["error"].get("message", ""))
    if "progress" in event:
        return f"progress {json.dumps(event['progress'])}"
    response = event.get("response")
    return str(response.get("status", "")) if isinstance(response, dict) else ""


def service_log(data_dir: Path, explicit_data_dir: bool, args: argparse.Namespace) -> int:
    """The log of the service for this data folder (running or not): the one its service.json
    names, else where the service would write it."""
    try:
        file = Path(json.loads((data_dir / paths.SERVICE_FILE).read_text())["log_file"])
    except (OSError, ValueError, KeyError, TypeError):
        file = logs.log_dir(data_dir, explicit_data_dir) / logs.LOG_FILE
    if not file.is_file():
        raise CliError(f"No log yet at {file}.")
    lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    for line in lines[-args.lines:] if args.lines else []:
        say(line)
    if not args.follow:
        return 0
    try:
        follow_file(file)
    except KeyboardInterrupt:
        return 0
    return 0


def follow_file(file: Path) -> None:
    """What is written to `file` from now on, until Ctrl-C; a rotation (a file shorter than what
    was read of it) is read from its start."""
    read = file.stat().st_size
    while True:
        time.sleep(POLL_SECONDS)
        try:
            size = file.stat().st_size
        except FileNotFoundError:  # between a rotation's rename and the new file
            continue
        if size < read:
            read = 0
        if size > read:
            with file.open("rb") as handle:
                handle.seek(read)
                chunk = handle.read(size - read)
            read += len(chunk)
            say(chunk.decode("utf-8", errors="replace"), lines=True, end="", flush=True)
