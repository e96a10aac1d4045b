"""`lmsp-tray show MODEL`: what a model is (family, size, quantization, context, memory)."""

from __future__ import annotations

import argparse
import json
from urllib.parse import quote

from app.cli.client import Client, say
from app.display import facts, is_remote


def show(client: Client, args: argparse.Namespace) -> int:
    model = client.call("GET", f"/v1/models/{quote(args.model, safe='')}")
    if args.json:
        say(json.dumps(model, indent=2), lines=True)
        return 0
    lines = [("Model", model["id"]), ("Status", model["status"])]
    if is_remote(model):
        lines += [("Endpoint", f"{e['base_url']} ({e['status']})") for e in model.get("endpoints") or []]
    else:
        lines += [("File", model.get("path") or "—"), *facts(model)]
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        say(f"{label + ':':<{width + 1}} {value}")
    return 0
