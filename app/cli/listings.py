"""What the service holds and does, as tables (or `--json`): status, ls, ps, tasks, usage, pairings."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from app.cli.client import Client, CliError, cell, listing, say
from app.display import human_size, is_remote, processor_text, short_digest

ACTIVE = ("queued", "loading", "running", "cancelling")


def status(client: Client, args: argparse.Namespace) -> int:
    info = client.call("GET", "/lmsp")
    tasks = client.call("GET", "/v1/tasks?limit=100")["data"]
    loaded = [m["id"] for m in client.call("GET", "/v1/models")["data"] if m["status"] == "loaded"]
    counts = {state: sum(t["status"] == state for t in tasks) for state in ACTIVE}
    if args.json:
        say(json.dumps({"url": client.url, "service": info["service"], "version": client.info.get("version"),
                          "tasks": counts, "loaded_models": loaded,
                          "recovered_from_corruption": info.get("recovered_from_corruption")}, indent=2), lines=True)
        return 0
    say(f"LMSP Tray serving on {client.url} (service {info['service']['id']})")
    say(f"{counts['running']} running, {counts['queued']} queued")
    say(f"loaded: {', '.join(loaded) or 'no model'}")
    if info.get("recovered_from_corruption"):
        say(f"note: a corrupt database was moved aside to {info['recovered_from_corruption']}")
    return 0


def models(client: Client, args: argparse.Namespace) -> int:
    data = client.call("GET", "/v1/models")["data"]
    listing(args.json, data, ["ID", "STATUS", "SIZE", "DIGEST"], [
        [m["id"], m["status"], "remote" if is_remote(m) else human_size(m["size_bytes"]),
         (m.get("digest") or "")[:19]] for m in data])
    return 0


def ps(client: Client, args: argparse.Namespace) -> int:
    """The loaded models, as `ollama ps` shows them: what each takes, on what, for how long."""
    loaded = [m for m in client.call("GET", "/v1/models")["data"] if m["status"] == "loaded"]
    idle = client.call("GET", "/v1/settings")["model_idle_ttl_seconds"]
    until = "Forever" if not idle else f"{idle // 60} min idle" if idle >= 60 else f"{idle} s idle"
    listing(args.json, loaded, ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "PARALLEL", "UNTIL"], [
        [m["id"], short_digest(m.get("digest")), human_size(m.get("memory_bytes")),
         _processor(m), cell(m.get("context_length")), cell(m.get("parallel")), until]
        for m in loaded])
    return 0


def _processor(model: dict[str, Any]) -> str:
    """Where it runs, as `ollama ps` says it; safe mode (no fast CPU kernels) is worth knowing."""
    mode = (model.get("engine") or {}).get("mode")
    return processor_text(model.get("processor")) + (" (safe mode)" if mode == "safe" else "")


def tasks(client: Client, args: argparse.Namespace) -> int:
    data = client.call("GET", "/v1/tasks?limit=50")["data"]
    listing(args.json, data, ["ID", "STATUS", "MODEL", "PROGRESS", "QUEUE", "SLOT", "POLICY"], [
        [t["id"], t["status"], t["model"], _progress(t["progress"]), cell(t.get("queue_position")),
         _slot(t.get("slot")), t["on_restart"]] for t in data])
    return 0


def _slot(slot: dict[str, Any] | None) -> str:
    """A running task's seat among those its model decodes together: 2/4."""
    return "-" if slot is None else f"{slot['index'] + 1}/{slot['of']}"


def _progress(progress: dict[str, Any]) -> str:
    if "bytes" in progress:  # a download
        return f"{progress['bytes'] / 1e6:,.0f}/{progress['total_bytes'] / 1e6:,.0f} MB"
    return f"{progress['output_tokens']} tokens"


def usage(client: Client, args: argparse.Namespace) -> int:
    """What each app has used (GET /v1/usage): in all, or over the last `--days` UTC days."""
    if args.days is not None and args.days < 1:
        raise CliError("usage: lmsp-tray usage [--days N], N at least 1", code=2)
    first = None if args.days is None else time.gmtime(time.time() - (args.days - 1) * 86400)
    since = "" if first is None else time.strftime("&from=%Y-%m-%d", first)
    data = client.call("GET", f"/v1/usage?group_by=client{since}")["data"]
    listing(args.json, data, ["APP", "ID", "REQUESTS", "COMPLETED", "FAILED", "INPUT TOKENS", "OUTPUT TOKENS"], [
        [u["client_name"], u["client_id"], str(u["requests"]), str(u["tasks_completed"]), str(u["tasks_failed"]),
         str(u["input_tokens"]), str(u["output_tokens"])] for u in data])
    return 0


def pairings(client: Client, args: argparse.Namespace) -> int:
    if args.action:
        if args.id is None:
            raise CliError("usage: lmsp-tray pairings [approve ID | deny ID]", code=2)
        done = client.call("POST", f"/v1/pairings/{args.id}/{args.action}")
        say(f"{done['client_name']}: {done['status']}")
        return 0
    waiting = client.call("GET", "/v1/pairings")["data"]
    if not waiting and not args.json:
        say("No pairing requests are waiting.")
        return 0
    # The name last: whatever it holds, it cannot push the real code and scopes off the row.
    listing(args.json, waiting, ["ID", "CODE", "SCOPES", "APP"], [
        [p["id"], p["code"], ",".join(p["scopes"]), p["client_name"]] for p in waiting])
    return 0
