"""`lmsp-tray run MODEL [PROMPT]`: talk to a model from a terminal, as `ollama run` does.

With a prompt (or one piped in) it prints the answer as it streams and exits; without, it is a
chat, each turn continuing the last through `previous_response_id`. Ctrl-C while an answer
streams cancels its task (the service stops generating; the conversation goes on from the
answer before); `--background` only starts the task and prints its id; `--verbose` adds the
timings `ollama run --verbose` prints, read from the stream's own event times."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from app.cli.client import Client, CliError, say

HELP = "Use Ctrl + d or /bye to exit; /clear starts a new conversation."
DELTA = "response.output_text.delta"
THINKING = "response.reasoning_text.delta"  # a thinking model's reasoning, printed as `ollama run` does


class Cancelled(Exception):
    pass


def run(client: Client, args: argparse.Namespace) -> int:
    prompt = " ".join(args.prompt)
    if not prompt and not sys.stdin.isatty():  # `echo "..." | lmsp-tray run MODEL`
        prompt = sys.stdin.read()
    base = {"model": args.model, **({"max_output_tokens": args.max_tokens} if args.max_tokens else {}),
            **({"temperature": args.temperature} if args.temperature is not None else {})}
    if args.background:
        if not prompt.strip():
            raise CliError("--background needs a prompt.", code=2)
        created = client.call("POST", "/v1/responses", {**base, "input": prompt, "background": True})
        say(created["task"]["id"])
        return 0
    if prompt.strip():
        try:
            answer(client, {**base, "input": prompt}, args.verbose)
        except Cancelled:
            return 130
        return 0
    # A model that does not exist is said before the first prompt.
    client.call("GET", f"/v1/models/{quote(args.model, safe='')}")
    return chat(client, base, args.verbose)


def chat(client: Client, base: dict[str, Any], verbose: bool) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input(), where Python has it)
    except ImportError:
        pass
    previous: str | None = None
    while True:
        try:
            text = input(">>> ").strip()
        except EOFError:
            say("")
            return 0
        except KeyboardInterrupt:
            say(f"\n{HELP}", lines=True)
            continue
        if text in ("/bye", "/exit"):
            return 0
        if text in ("/?", "/help"):
            say(HELP)
        elif text == "/clear":
            previous = None
            say("A new conversation.")
        elif text:
            body = {**base, "input": text, **({"previous_response_id": previous} if previous else {})}
            try:
                previous = answer(client, body, verbose)["id"]
            except Cancelled:
                pass
            except CliError as exc:  # said, and the chat goes on
                say(f"lmsp-tray: {exc}", file=sys.stderr)


def answer(client: Client, body: dict[str, Any], verbose: bool) -> dict[str, Any]:
    """Send one prompt and print its answer as it streams; the final response. Ctrl-C cancels
    the task and raises Cancelled."""
    times = Timings()
    task_id: str | None = None
    final: dict[str, Any] = {}
    thinking = False  # the reasoning is being printed
    try:
        for event in client.stream("POST", "/v1/responses", {**body, "stream": True}):
            task_id = task_id or event.get("task_id")
            times.mark(event)
            if event["type"] == THINKING:
                say(("" if thinking else "Thinking...\n") + event["delta"], lines=True, end="", flush=True)
                thinking = True
            elif event["type"] == DELTA:
                say(("\n...done thinking.\n\n" if thinking else "") + event["delta"], lines=True, end="",
                    flush=True)
                thinking = False
            final = event.get("response") or final
    except KeyboardInterrupt:
        say("")
        if task_id is not None:
            try:
                client.call("POST", f"/v1/tasks/{task_id}/cancel")
            except CliError as exc:  # finished meanwhile
                say(f"lmsp-tray: {exc}", file=sys.stderr)
        say(f"Cancelled task {task_id}.", file=sys.stderr)
        raise Cancelled from None
    say("\n...done thinking." if thinking else "")  # it reasoned, then called a function or was cut off
    if final.get("status") == "failed":
        error = final.get("error") or {}
        raise CliError(f"{error.get('message', 'The answer failed.')} ({error.get('code', 'failed')})")
    if verbose:
        say(times.summary(final.get("usage") or {}), lines=True, file=sys.stderr)
    return final


@dataclass
class Timings:
    """The service's times of the events that mark a generation's phases."""
    at: dict[str, float] = field(default_factory=dict)

    def mark(self, event: dict[str, Any]) -> None:
        kind = event["type"].removeprefix("response.").replace("reasoning_text.", "output_text.")  # output all the same
        stamp = float(event.get("created_at") or 0.0)
        for name in ("created", "loading", "in_progress", "output_text.delta"):
            if kind == name and name not in self.at:  # the first of each
                self.at[name] = stamp
        self.at["end"] = stamp

    def summary(self, usage: dict[str, Any]) -> str:
        at = self.at
        start, end = at.get("created", 0.0), at.get("end", 0.0)
        running = at.get("in_progress", end)
        first = at.get("output_text.delta", end)
        prompt_tokens = usage.get("input_tokens", 0) - (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        lines = [("total duration", duration(end - start)),
                 ("load duration", duration(running - at.get("loading", running))),
                 ("prompt eval count", f"{prompt_tokens} token(s)"),
                 ("prompt eval duration", duration(first - running)),
                 ("prompt eval rate", rate(prompt_tokens, first - running)),
                 ("eval count", f"{usage.get('output_tokens', 0)} token(s)"),
                 ("eval duration", duration(end - first)),
                 ("eval rate", rate(usage.get("output_tokens", 0), end - first))]
        return "\n".join(f"{name + ':':<22}{value}" for name, value in lines)


def duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    return f"{seconds:.3f}s" if seconds >= 1 else f"{seconds * 1000:.3f}ms"


def rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.2f} tokens/s" if seconds > 0 else "-"
