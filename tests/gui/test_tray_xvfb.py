"""End to end on a real X server: the app's icon embedded in a real tray host, the welcome of a
first start, its menu, the dashboard brought forward by a second launch, every tab, a pairing
request, Quit.

Screenshots go to test-output/screenshots/ (gitignored) for people to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Processes
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "test-output" / "screenshots"
SCREEN = (1280, 800)

pytestmark = [pytest.mark.gui, pytest.mark.skipif(
    not (shutil.which("Xvfb") and shutil.which("trayer")), reason="needs Xvfb and trayer (see TESTING-GUI.md)")]


class Screen:
    """An Xvfb display (a free number chosen by Xvfb itself) with trayer as the tray host."""

    def __init__(self, procs: Processes, size: tuple[int, int] = SCREEN) -> None:
        read, write = os.pipe()
        self.xvfb = procs.popen(["Xvfb", "-displayfd", str(write), "-screen", "0", f"{size[0]}x{size[1]}x24",
                                      "-nolisten", "tcp"], pass_fds=(write,), stderr=subprocess.DEVNULL)
        os.close(write)
        with os.fdopen(read) as pipe:
            self.display = ":" + pipe.readline().strip()
        self.env = {**os.environ, "DISPLAY": self.display}
        self.env.pop("QT_QPA_PLATFORM", None)  # the real xcb platform, not offscreen
        self.trayer = procs.popen(["trayer", "--edge", "top", "--align", "right", "--widthtype", "pixel",
                                        "--width", "160", "--height", "24"], env=self.env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: '"panel"' in self.tree(), 60, 0.1, "trayer's panel")  # slow beside 3 workers

    def run(self, *args: str) -> str:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=30).stdout

    def tree(self) -> str:
        return self.run("xwininfo", "-root", "-tree")

    def tray_icon(self) -> tuple[int, int] | None:
        """The centre of our window inside trayer's panel, once it is embedded there."""
        lines = self.tree().splitlines()
        panel = next((i for i, line in enumerate(lines) if '("panel" "trayer")' in line), None)
        if panel is None:
            return None
        depth = len(lines[panel]) - len(lines[panel].lstrip())
        for line in lines[panel + 1:]:
            if len(line) - len(line.lstrip()) <= depth:
                break  # left the panel's subtree
            found = re.search(r'"lmsp-tray" "LMSP Tray"\)\s+(\d+)x(\d+)\S*\s+\+(-?\d+)\+(-?\d+)', line)
            if found:
                w, h, x, y = map(int, found.groups())
                return x + w // 2, y + h // 2
        return None

    def settled_window(self, title: str, timeout: float) -> tuple[int, int, int, int]:
        """The window's box once two readings half a second apart agree: a window that just
        mapped may still be laid out (word-wrapped labels), moving the buttons a test clicks."""
        def settled() -> tuple[int, int, int, int] | None:
            first = self.window(title)
            time.sleep(0.5)
            return first if first is not None and first == self.window(title) else None
        return wait_until(settled, timeout, 0.1, f"window {title!r} shown and settled")

    def click_until(self, x: int, y: int, done: Callable[[], Any], what: str, tries: int = 3,
                    button: int = 1) -> Any:
        """Click, and again if nothing came of it within 5 s: a click that lands while the app
        is still starting can be lost, and a person would click again. Each miss is a screenshot."""
        for attempt in range(1, tries + 1):
            self.click(x, y, button)
            try:
                return wait_until(done, 5, 0.1, what)
            except TimeoutError:
                self.shot(f"missed-click-{attempt}-" + re.sub(r"\W+", "-", what))
        raise TimeoutError(f"{what}: not after {tries} clicks at ({x}, {y})")

    def open_menu(self, icon: tuple[int, int]) -> tuple[int, int, int, int]:
        """Right-click the tray icon until its menu shows: a window of the app's at the top of the
        screen, narrower than any of its other windows. The menu's box."""
        def menu() -> tuple[int, int, int, int] | None:
            box = self.window("LMSP Tray")
            return box if box is not None and box[1] < 60 and box[2] < 400 else None
        box: tuple[int, int, int, int] = self.click_until(*icon, menu, "tray menu shown", button=3)
        time.sleep(0.3)  # drawn
        return box

    def window(self, title: str) -> tuple[int, int, int, int] | None:
        """x, y, width, height of a mapped top-level window with this exact title."""
        pattern = re.compile(f'"{re.escape(title)}"'
                             r': \("lmsp-tray" "LMSP Tray"\)\s+(\d+)x(\d+)\S*\s+\+(-?\d+)\+(-?\d+)')
        for line in self.tree().splitlines():
            found = pattern.search(line)
            if found:
                w, h, x, y = map(int, found.groups())
                if w > 50 and self.mapped(line.split()[0]):
                    return x, y, w, h
        return None

    def mapped(self, window_id: str) -> bool:
        return "IsViewable" in self.run("xwininfo", "-id", window_id)

    def shot(self, name: str, box: tuple[int, int, int, int] | None = None) -> Path:
        SHOTS.mkdir(parents=True, exist_ok=True)
        target = SHOTS / f"{name}.png"
        full = target.with_suffix(".full.png")
        subprocess.run(["import", "-window", "root", str(full)], env=self.env, check=True, timeout=30)
        if box is None:
            full.replace(target)
        else:
            x, y, w, h = box
            subprocess.run(["convert", str(full), "-crop", f"{w}x{h}+{x}+{y}", "+repage", str(target)], check=True)
            full.unlink()
        return target

    def key(self, *keys: str) -> None:
        for key in keys:
            self.run("xdotool", "key", key)
            time.sleep(0.15)

    def click(self, x: int, y: int, button: int = 1) -> None:
        self.run("xdotool", "mousemove", str(x), str(y), "click", str(button))


class App:
    """The desktop app, and its second launches, ended with the test by `procs`."""

    def __init__(self, screen: Screen, data_dir: Path, procs: Processes) -> None:
        self.screen, self.data_dir, self.procs = screen, data_dir, procs
        self.log = data_dir.parent / "app.log"
        self.proc = self.launch(self.log.open("wb"))
        self.url = wait_until(self._url, 60, 0.1, "service.json")
        self.token = (data_dir / "owner_token").read_text().strip()

    def launch(self, out: Any = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        env = {**self.screen.env, "PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"}
        return self.procs.popen([sys.executable, "-m", "app", "--data-dir", str(self.data_dir), "--port", "0"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def _url(self) -> str | None:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return json.loads((self.data_dir / "service.json").read_text())["url"]
        except (OSError, ValueError, KeyError):
            return None

    def call(self, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
        request = urllib.request.Request(self.url + path, method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {token or self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def task(self, task_id: str) -> dict[str, Any]:
        return self.call("GET", f"/v1/tasks/{task_id}")


@pytest.fixture
def screen(procs: Processes) -> Screen:
    return Screen(procs)


def test_tray_menu_dashboard_and_pairing_on_a_real_screen(screen: Screen, tmp_path: Path, procs: Processes) -> None:
    app = App(screen, tmp_path / "data", procs)
    icon = wait_until(screen.tray_icon, 30, 0.1, "icon embedded in trayer's panel")
    menu_box = (SCREEN[0] - 560, 0, 560, 260)

    # A fresh data folder is a first start: the welcome window, closed here with its Close
    # button ("Don't show this again" left unticked).
    wx, wy, ww, wh = screen.settled_window("Welcome to LMSP Tray", 30)
    screen.shot("welcome", (wx, wy, ww, wh))
    screen.click_until(wx + ww - 60, wy + wh - 26,  # Close, at the bottom right
                       lambda: screen.window("Welcome to LMSP Tray") is None, "welcome closed")

    # Work to show: a short task that completes, a long one that keeps the engine busy.
    def submit(tokens: int, text: str, token: str | None = None) -> str:
        body = {"input": text, "background": True, "max_output_tokens": tokens, "temperature": 0}
        return app.call("POST", "/v1/responses", body, token)["task"]["id"]
    short = submit(8, "Name three colours.")
    long = submit(400, "Tell a long story about a lighthouse keeper.")

    # The tray menu, opened as a person does: right-click on the icon.
    screen.open_menu(icon)
    screen.shot("tray-menu", menu_box)
    screen.key("Down", "Down", "Right")  # Open dashboard, Models, into the submenu
    time.sleep(0.5)
    screen.shot("tray-menu-models", (SCREEN[0] - 800, 0, 800, 260))
    screen.key("Escape", "Escape")

    # A pairing request: the tray's notification; clicking it opens the pairing dialog. Once the
    # short task has run: on a CPU where fast mode crashes, the first load's "Running in safe
    # mode" balloon comes then, and on a slow machine it would replace the pairing's.
    wait_until(lambda: app.task(short)["status"] == "completed", 120, 0.1, "short task completed")
    time.sleep(1.0)
    pairing = app.call("POST", "/v1/pairings", {"client_name": "Notes App",
                                                 "scopes": ["responses:write", "models:read", "tasks:read"]})
    time.sleep(1.5)
    screen.shot("tray-notification", (SCREEN[0] - 560, 0, 560, 160))
    screen.click_until(icon[0] - 150, icon[1] + 55,  # the message balloon, just below the icon
                       lambda: screen.window("Allow an app to use your models?"), "pairing dialog shown")
    dx, dy, dw, dh = screen.settled_window("Allow an app to use your models?", 20)
    screen.shot("pairing-dialog", (dx, dy, dw, dh))
    assert app.call("GET", f"/v1/pairings/{pairing['id']}")["status"] == "pending"
    granted = screen.click_until(dx + dw - 137, dy + dh - 24,  # Allow (Deny, the default, is to its right)
                                 lambda: app.call("GET", f"/v1/pairings/{pairing['id']}").get("token"), "approved")
    submit(8, "Say hello.", granted)  # the paired app's task waits behind the long one

    # A second launch does not start a second service: it brings the dashboard forward.
    wait_until(lambda: app.task(long)["progress"]["output_tokens"] >= 4, 60, 0.1, "long task under way")
    second = app.launch()
    assert second.wait(30) == 0
    box = screen.settled_window("LMSP Tray", 20)
    x, y, w, h = box
    screen.click(x + 300, y + 125)  # the second row: the long task, running
    time.sleep(1.5)
    for tab in ("tasks", "models", "clients", "settings"):
        screen.shot(f"dashboard-{tab}", box)
        screen.key("ctrl+Tab")
        time.sleep(0.5)

    # Quit from the tray menu: the service stops in order and the app exits 0.
    screen.open_menu(icon)
    screen.key("Up", "Return")  # from the top, Up wraps to the last entry: Quit
    assert app.proc.wait(60) == 0, app.log.read_text()[-3000:]
    assert not (app.data_dir / "service.json").exists()
    assert "stopped cleanly" in app.log.read_text()
