"""`lmsp-tray status|models|tasks|pairings|token|pull|hub-token`: scripting the running service.

Each command finds the service through `service.json` in the data folder and speaks to it
over HTTP with the owner token, exactly as any other local app would.
"""

from __future__ import annotations

import getpass
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from keyring.errors import KeyringError

from app import paths
from app.core.pairing import shown
from app.display import human_size, is_remote
from app.pull import pull
from app.secrets import owner_vault, set_hub_token

COMMANDS = ("status", "models", "tasks", "pairings", "token", "pull", "hub-token")


class CliError(Exception):
    pass


class Client:
    def __init__(self, data_dir: Path) -> None:
        try:
            self.url = json.loads((data_dir / paths.SERVICE_FILE).read_text())["url"]
        except (OSError, ValueError, KeyError):
            raise CliError(f"LMSP Tray is not running (no {paths.SERVICE_FILE} in {data_dir}).") from None
        self.token = owner_vault(data_dir).get()

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        req = urllib.request.Request(self.url + path, method=method, data=data,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            body = json.loads(err.read() or b"{}")
            raise CliError(body.get("error", {}).get("message", f"HTTP {err.code}")) from None
        except urllib.error.URLError as err:
            raise CliError(f"LMSP Tray at {self.url} does not answer ({err.reason}).") from None


def _table(rows: list[list[str]]) -> str:
    """Aligned columns; a cell's control characters are shown escaped, never sent to the terminal."""
    if not rows:
        return ""
    rows = [[shown(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def run(command: str, args: list[str], data_dir: Path) -> int:
    try:
        if command == "token":
            token = owner_vault(data_dir).get()
            if token is None:
                raise CliError("No owner token yet: start LMSP Tray once to create it.")
            print(token)
            return 0
        if command == "hub-token":
            return _hub_token()
        client = Client(data_dir)
        if command == "pull":
            return pull(client.call, args)
        if command == "status":
            info = client.call("GET", "/lmsp")
            tasks = client.call("GET", "/v1/tasks?limit=100")["data"]
            active = [t for t in tasks if t["status"] in ("queued", "loading", "running", "cancelling")]
            print(f"LMSP Tray serving on {client.url} (service {info['service']['id']})")
            print(f"{sum(t['status'] == 'running' for t in active)} running, "
                  f"{sum(t['status'] == 'queued' for t in active)} queued")
            if info.get("recovered_from_corruption"):
                print(f"note: a corrupt database was moved aside to {info['recovered_from_corruption']}")
        elif command == "models":
            models = client.call("GET", "/v1/models")["data"]
            print(_table([["ID", "STATUS", "SIZE", "DIGEST"]] + [
                [m["id"], m["status"], "remote" if is_remote(m) else human_size(m["size_bytes"]),
                 (m.get("digest") or "")[:19]] for m in models]))
        elif command == "tasks":
            tasks = client.call("GET", "/v1/tasks?limit=50")["data"]
            print(_table([["ID", "STATUS", "MODEL", "PROGRESS", "POLICY"]] + [
                [t["id"], t["status"], t["model"], _progress(t["progress"]), t["on_restart"]] for t in tasks]))
        elif command == "pairings":
            return _pairings(client, args)
        return 0
    except CliError as exc:
        print(f"lmsp-tray: {exc}", file=sys.stderr)
        return 1


def _progress(progress: dict[str, Any]) -> str:
    if "bytes" in progress:  # a download
        return f"{progress['bytes'] / 1e6:,.0f}/{progress['total_bytes'] / 1e6:,.0f} MB"
    return f"{progress['output_tokens']} tokens"


def _hub_token() -> int:
    """Save the Hugging Face token (read from the terminal, never an argument: shells keep
    history) in the OS keyring, for gated and private repositories; empty forgets it."""
    token = getpass.getpass("Hugging Face token (empty to forget it): ") if sys.stdin.isatty() else sys.stdin.read()
    try:
        set_hub_token(token.strip() or None)
    except (KeyringError, RuntimeError) as exc:
        raise CliError(f"No keyring to keep it in ({type(exc).__name__}); set HF_TOKEN instead.") from None
    print("Saved in the keyring." if token.strip() else "Forgotten.")
    return 0


def _pairings(client: Client, args: list[str]) -> int:
    if len(args) == 2 and args[0] in ("approve", "deny"):
        done = client.call("POST", f"/v1/pairings/{args[1]}/{args[0]}")
        print(f"{shown(done['client_name'])}: {done['status']}")
        return 0
    if args:
        raise CliError("usage: lmsp-tray pairings [approve ID | deny ID]")
    waiting = client.call("GET", "/v1/pairings")["data"]
    if not waiting:
        print("No pairing requests are waiting.")
    else:
        # The name last: whatever it holds, it cannot push the real code and scopes off the row.
        print(_table([["ID", "CODE", "SCOPES", "APP"]] + [
            [p["id"], p["code"], ",".join(p["scopes"]), p["client_name"]] for p in waiting]))
    return 0
