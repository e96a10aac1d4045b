"""The command line's commands, scripting the running service as `ollama` and `lms` do:
run, ps, ls/models, show, pull, rm, load, unload/stop, tasks, cancel, logs, usage, status, pairings,
token, hub-token.

argparse's subcommands (the standard library: nothing to install or to freeze into the desktop
app, and `lmsp-tray --headless` already parses with it): each command has its own options, a
`--help`, and the usage errors argparse says with exit status 2. Every other failure is one line
on stderr and exit status 1 (the service not running among them)."""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from keyring.errors import KeyringError

from app.cli import chat, listings, show
from app.cli import logs as log_commands
from app.cli.client import Client, CliError, say
from app.cli.pull import pull
from app.secrets import owner_vault, set_hub_token

Command = Callable[[Client, argparse.Namespace], int]


# long: one declaration per command, read as the command line's table of contents
def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser],
                 parents: list[argparse.ArgumentParser]) -> None:
    """The commands, on the subparsers of `lmsp-tray`; each takes `parents`' options (--data-dir)."""
    listed = argparse.ArgumentParser(add_help=False, parents=parents)
    listed.add_argument("--json", action="store_true", help="the API's objects as JSON, for a script")

    def add(name: str, about: str, func: Command | None, *, aliases: tuple[str, ...] = (),
            listing: bool = False) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, aliases=list(aliases), help=about, description=about,
                                     parents=[listed] if listing else parents)
        parser.set_defaults(func=func)
        return parser

    run = add("run", "talk to a model: a chat, or one answer to PROMPT", chat.run)
    run.add_argument("model", metavar="MODEL")
    run.add_argument("prompt", metavar="PROMPT", nargs="*", help="answer this and exit (default: a chat)")
    run.add_argument("--verbose", action="store_true", help="timings after each answer")
    run.add_argument("--background", action="store_true", help="start the task, print its id and return")
    run.add_argument("--max-tokens", type=int, metavar="N", help="an answer's length at most, in tokens")
    run.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (0: the likeliest token, "
                     "the same answer each time)")
    add("ps", "the loaded models", listings.ps, listing=True)
    add("ls", "the models LMSP Tray knows", listings.models, aliases=("models", "list"), listing=True)
    add("show", "what a model is: family, size, quantization, context, memory", show.show,
        listing=True).add_argument("model", metavar="MODEL")
    pull_it = add("pull", "download a model from the Hugging Face hub, with a progress bar", _pull)
    pull_it.add_argument("repo", metavar="OWNER/NAME")
    pull_it.add_argument("file", metavar="FILE.gguf")
    pull_it.add_argument("revision", nargs="?", metavar="REVISION")
    for name, about, func in (("rm", "remove a model from LMSP Tray", _remove),
                              ("load", "load a model now", _act("/v1/models/{model}/load")),
                              ("unload", "unload a model", _act("/v1/models/{model}/unload"))):
        add(name, about, func, aliases=("stop",) if name == "unload" else ()).add_argument("model", metavar="MODEL")
    add("tasks", "the latest tasks: queued, running and done", listings.tasks, listing=True)
    add("cancel", "cancel a task", _act("/v1/tasks/{task}/cancel")).add_argument("task", metavar="TASK")
    logs = add("logs", "a task's events, or the service's log", None, listing=True)
    logs.add_argument("task", metavar="TASK", nargs="?", help="this task's events (default: the service's log)")
    logs.add_argument("-f", "--follow", action="store_true", help="go on with what comes next, as it comes")
    logs.add_argument("-n", "--lines", type=int, default=50, help="the service log's last lines (default 50)")
    usage = add("usage", "what each app has used", listings.usage, listing=True)
    usage.add_argument("--days", type=int, metavar="N", help="over the last N days (UTC days; default: all kept)")
    add("status", "whether the service runs, and what it does", listings.status, listing=True)
    pairings = add("pairings", "pairing requests waiting, or approve or deny one", listings.pairings, listing=True)
    pairings.add_argument("action", nargs="?", choices=("approve", "deny"))
    pairings.add_argument("id", nargs="?", metavar="ID")
    add("token", "print the owner token", None)  # these three may run without the service
    add("hub-token", "keep a Hugging Face token in the keyring", None)


def run(args: argparse.Namespace, data_dir: Path, explicit_data_dir: bool) -> int:
    try:
        if args.func is not None:
            return int(args.func(Client(data_dir), args))
        if args.command == "token":
            return _token(data_dir)
        if args.command == "hub-token":
            return _hub_token()
        if args.task is not None:  # logs TASK
            return log_commands.task_log(Client(data_dir), args)
        return log_commands.service_log(data_dir, explicit_data_dir, args)
    except CliError as exc:
        say(f"lmsp-tray: {exc}", file=sys.stderr)
        return exc.code


def _pull(client: Client, args: argparse.Namespace) -> int:
    return pull(client.call, args.repo, args.file, args.revision)


def _remove(client: Client, args: argparse.Namespace) -> int:
    client.call("DELETE", f"/v1/models/{quote(args.model, safe='')}")
    say(f"Removed {args.model} from LMSP Tray (its file stays on disk).")
    return 0


def _act(path: str) -> Command:
    """A command that POSTs to `path` (filled in from its arguments) and prints where its model or
    task now stands: "ID: status"."""
    def act(client: Client, args: argparse.Namespace) -> int:
        filled = path.format(**{name: quote(str(value), safe="") for name, value in vars(args).items()})
        done = client.call("POST", filled)
        say(f"{done['id']}: {done['status']}")
        return 0
    return act


def _token(data_dir: Path) -> int:
    token = owner_vault(data_dir).get()
    if token is None:
        raise CliError("No owner token yet: start LMSP Tray once to create it.")
    say(token)
    return 0


def _hub_token() -> int:
    """Save the Hugging Face token (read from the terminal, never an argument: shells keep
    history) in the OS keyring, for gated and private repositories; empty forgets it."""
    token = getpass.getpass("Hugging Face token (empty to forget it): ") if sys.stdin.isatty() else sys.stdin.read()
    try:
        set_hub_token(token.strip() or None)
    except (KeyringError, RuntimeError) as exc:
        raise CliError(f"No keyring to keep it in ({type(exc).__name__}); set HF_TOKEN instead.") from None
    say("Saved in the keyring." if token.strip() else "Forgotten.")
    return 0
