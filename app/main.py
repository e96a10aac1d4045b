"""Startup and shutdown, in order, and the command line.

    lmsp-tray                      the desktop app (tray, dashboard, service)
    lmsp-tray --headless           the service alone (also: lmsp-tray serve)
    lmsp-tray run|ps|ls|pull|rm|load|unload|tasks|cancel|logs|usage|status|...   scripting the
                                   running service (app/cli/)
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO

from app import __version__, cli, durable, logs, paths
from app.core.service import AppService
from app.errors import LmspError
from app.server.app import Server

log = logging.getLogger("app")
# Open files the app asks for at start where it has fewer: macOS gives an app 256, Linux 1024.
FILES = 4096


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # The options a command may also take after its name (`lmsp-tray ps --data-dir X`): SUPPRESS
    # as their default, so that a subcommand's parser leaves a value given before it alone.
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--data-dir", default=argparse.SUPPRESS,
                       help="per-user state folder (default: $LMSP_DATA_DIR or the platform's)")
    listen = argparse.ArgumentParser(add_help=False)
    listen.add_argument("--host", default=argparse.SUPPRESS, help="address to bind for this run (default 127.0.0.1)")
    listen.add_argument("--port", type=int, default=argparse.SUPPRESS,
                        help="port for this run (default 11535; 0 = any free port)")
    parser = argparse.ArgumentParser(prog="lmsp-tray", description="Local language models for your apps (LMSP 1.0).",
                                     parents=[where, listen])
    parser.add_argument("--headless", action="store_true", help="run the service with no window")
    parser.add_argument("--version", action="version", version=f"lmsp-tray {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     title="commands (each has --help; they script the running service)")
    commands.add_parser("serve", parents=[where, listen], help="the service alone, with no window (as --headless)")
    cli.add_commands(commands, [where])
    args, extra = parser.parse_known_args(argv)
    if args.command == "run" and not any(word.startswith("-") for word in extra):
        args.prompt += extra  # a prompt's words after an option: `run MODEL --verbose why is the sky blue`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    for name in ("data_dir", "host", "port"):
        setattr(args, name, getattr(args, name, None))
    return args


class Lifecycle:
    """The service and its HTTP server, started and stopped in a fixed order.
    The desktop app drives the same object from Qt's loop."""

    def __init__(self, data_dir: Path, host: str | None, port: int | None) -> None:
        self.data_dir = data_dir
        self.service = AppService(data_dir)
        self.server = Server(self.service)
        self.host, self.port = host, port
        self.log_file: Path | None = None  # set by main(); the desktop app's "Open logs"
        self._lock: IO[bytes] | None = None

    async def start(self) -> str:
        self._lock = lock_data_dir(self.data_dir)
        if self._lock is None:
            raise LmspError("already_running", f"LMSP Tray is already running for {self.data_dir}{self._where()}.",
                            status=409, title="Already running")
        try:
            return await self._serve()
        except BaseException:
            self._release()  # not serving: another start may have the folder
            raise

    async def _serve(self) -> str:
        # Recovery (inside service.start) finishes before the port is even open.
        await self.service.start()
        settings = self.service.settings
        host = self.host or settings["host"]
        port = settings["port"] if self.port is None else self.port
        try:
            url = await self.server.start(host, port)
        except OSError as exc:
            await self.service.stop()
            title = "The port is in use" if exc.errno == errno.EADDRINUSE else "The address is not available"
            raise LmspError("cannot_listen", f"Cannot serve on {host}:{port}: {exc.strerror or exc}.",
                            status=503, title=title) from None
        self._write_service_file(url)
        log.info("serving LMSP on %s (data in %s)", url, self.data_dir)
        return url

    async def stop(self) -> None:
        # Stop accepting, snapshot running work, close streams, close the store.
        await self.server.stop_accepting()
        await self.service.stop()
        await self.server.stop()
        self._release()
        log.info("stopped cleanly")

    def _release(self) -> None:
        if self._lock is not None:  # only the process that holds the folder wrote its service.json
            durable.remove(self.data_dir / paths.SERVICE_FILE)
            self._lock.close()  # closing the file releases the lock
            self._lock = None

    def _where(self) -> str:
        """" at <url>" of the service holding the lock, from its service.json (unless it is
        still starting and has not written it yet)."""
        try:
            return f" at {json.loads((self.data_dir / paths.SERVICE_FILE).read_text(encoding='utf-8'))['url']}"
        except (OSError, ValueError, KeyError, TypeError):
            return ""

    def _write_service_file(self, url: str) -> None:
        info = {"url": url, "pid": os.getpid(), "version": __version__,
                "log_file": str(self.log_file) if self.log_file else None,  # for `lmsp-tray logs`
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        durable.write(self.data_dir / paths.SERVICE_FILE, json.dumps(info, indent=2))


def lock_data_dir(data_dir: Path) -> IO[bytes] | None:
    """Claim the data folder for this process: two services on one database would each run the
    other's tasks. An exclusive lock on paths.LOCK_FILE, held while the returned file stays open;
    None if another process holds it. The kernel releases it when the holder ends, however it
    ends (a crash, SIGKILL, a power cut), so nothing left on disk can keep the app from starting,
    unlike a pid in service.json, which may by then be another process's."""
    data_dir.mkdir(parents=True, exist_ok=True)
    # Not `with`: the lock lasts as long as the file is open, so the caller keeps it open.
    handle = open(data_dir / paths.LOCK_FILE, "a+b")  # noqa: SIM115  (never truncated: another may hold it)
    try:
        if sys.platform == "win32":  # untested: a lock on the first byte, released with the handle
            import msvcrt

            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def stop_on_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT (Ctrl+C) set `stop`: through the loop's own handlers, or on Windows, whose
    loop has none, through Python's, which run on the main thread and hand it to the loop."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        if sys.platform == "win32":
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))
        else:
            loop.add_signal_handler(sig, stop.set)


async def run_headless(life: Lifecycle) -> int:
    stop = asyncio.Event()
    stop_on_signals(asyncio.get_running_loop(), stop)
    await life.start()
    await stop.wait()
    await life.stop()
    return 0


def has_screen() -> bool:
    """On Linux and the BSDs a window needs an X11 or Wayland display (or a Qt platform chosen
    explicitly, as tests do); elsewhere there always is one."""
    if not sys.platform.startswith(("linux", "freebsd", "openbsd")):
        return True
    return any(os.environ.get(name) for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))


def fill_standard_streams() -> None:
    """A launcher may start the app with standard input, output or error closed: the next file
    opened would take that number, and stderr's writes (ours, and those of a process started
    with it) would land in it (seen: the log file, every line twice). The
    null device takes the number instead."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one


def raise_file_limit(want: int = FILES) -> None:
    """The open-file soft limit raised to `want` (the hard limit, if that is lower) where it is
    lower: macOS starts an app with 256, which would cap the server at 64 connections (its cap is a
    quarter of the limit: app/server/gate.py). Windows counts no sockets against one."""
    if sys.platform == "win32":
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # the limit stays; the cap follows it
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)


def main(argv: list[str] | None = None) -> int:
    # In a frozen app the grammar worker (spawn) and multiprocessing's resource tracker are this
    # same executable: run them and exit here, before the command line is parsed. No-op otherwise.
    multiprocessing.freeze_support()
    args = parse_args(argv)
    data_dir = paths.data_dir(args.data_dir)
    explicit_data_dir = bool(args.data_dir or os.environ.get("LMSP_DATA_DIR"))
    if args.command not in (None, "serve"):
        return cli.run(args, data_dir, explicit_data_dir)
    fill_standard_streams()
    raise_file_limit()
    os.umask(0o077)  # whatever this process writes (database, WAL, logs, backups, lock) is private to the user
    log_file = logs.setup(logs.log_dir(data_dir, explicit_data_dir))
    life = Lifecycle(data_dir, args.host, args.port)
    life.log_file = log_file
    try:
        headless = args.headless or args.command == "serve"
        if headless or not has_screen():
            if not headless:
                log.warning("no screen to show a tray icon on: running the service without a window")
            return asyncio.run(run_headless(life))
        from app.gui.desktop import run_desktop  # Qt is imported only for the desktop app
        return run_desktop(life)
    except LmspError as exc:
        log.error("%s: %s", exc.title, exc.message)
        print(f"lmsp-tray: {exc.message}", file=sys.stderr)
        return 2
