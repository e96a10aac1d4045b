#!/usr/bin/env python3
"""Regenerate every raster icon (PNG, ICO, ICNS) from the SVG sources.

Needs:
  * Python 3.9+ with Pillow (>= 9.1; writes the .ico and .icns and re-saves PNGs).
  * An SVG renderer, either of:
      - `rsvg-convert` on PATH (Debian/Ubuntu: `apt-get install librsvg2-bin`), preferred; or
      - the `cairosvg` Python package (`pip install cairosvg`; needs the system libcairo).
  For example:
      python3 -m venv /tmp/icon-venv && /tmp/icon-venv/bin/pip install pillow
      apt-get install -y librsvg2-bin
      /tmp/icon-venv/bin/python icons/make_icons.py

Sources (edit these, then run this script; the outputs are committed):
  APP/hicolor/scalable/apps/lmsp-tray.svg   the app icon, 256x256 viewBox (also installed as is)
  tray-<state>.svg                the tray icons, 32x32 viewBox (used for 32 and 64 px)
  src/<name>-<N>.svg              optional hand-hinted variant drawn on an N x N pixel grid;
                                  used instead of the main source when rendering N px
                                  (the tray icons have them for 22 and 24 px, whose scale from
                                  32 would blur the glyphs; the app icon for 16, 22 and 24 px)

Outputs, where APP is app/resources/icons/ (package data: the app reads them at run time) and
the rest stays in this folder (only the PyInstaller build uses them):
  APP/tray-<state>-{16,22,24,32,64}.png
  APP/hicolor/<N>x<N>/apps/lmsp-tray.png for N in 16 22 24 32 48 64 128 256
  lmsp-tray.ico                         (16, 20, 24, 32, 40, 48, 64, 128, 256)
  lmsp-tray.icns                        (16@2x .. 512@2x)

Usage: make_icons.py [--renderer rsvg|cairosvg]
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
from pathlib import Path

try:
    from PIL import Image
except ImportError:  # pragma: no cover - a setup problem, not a code path
    sys.exit("make_icons.py needs Pillow: pip install pillow")

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
APP = HERE.parent / "app" / "resources" / "icons"

TRAY_STATES = ("starting", "idle", "busy", "paused", "error")
TRAY_SIZES = (16, 22, 24, 32, 64)
APP_NAME = "lmsp-tray"
APP_SOURCE = APP / "hicolor" / "scalable" / "apps" / f"{APP_NAME}.svg"
HICOLOR_SIZES = (16, 22, 24, 32, 48, 64, 128, 256)
ICO_SIZES = (16, 20, 24, 32, 40, 48, 64, 128, 256)
ICNS_SIZES = (32, 64, 128, 256, 512, 1024)  # what Pillow's ICNS writer stores (16@2x .. 512@2x)


def pick_renderer(choice: str | None):
    """Return a function (svg_path, size) -> RGBA PIL image."""

    def rsvg(svg: Path, size: int) -> Image.Image:
        png = subprocess.run(
            ["rsvg-convert", "--width", str(size), "--height", str(size), "--format", "png", str(svg)],
            check=True,
            capture_output=True,
        ).stdout
        return Image.open(io.BytesIO(png)).convert("RGBA")

    def cairo(svg: Path, size: int) -> Image.Image:
        import cairosvg  # noqa: PLC0415

        png = cairosvg.svg2png(url=str(svg), output_width=size, output_height=size)
        return Image.open(io.BytesIO(png)).convert("RGBA")

    if choice in (None, "rsvg") and shutil.which("rsvg-convert"):
        return rsvg
    if choice in (None, "cairosvg"):
        try:
            import cairosvg  # noqa: F401, PLC0415
        except ImportError:
            pass
        else:
            return cairo
    sys.exit(
        "make_icons.py: no SVG renderer found. Install librsvg2-bin (rsvg-convert) "
        "or `pip install cairosvg`."
    )


def source_for(name: str, size: int) -> Path:
    """The hand-hinted variant for this pixel size if there is one, else the main source."""
    hinted = SRC / f"{name}-{size}.svg"
    if hinted.exists():
        return hinted
    return APP_SOURCE if name == APP_NAME else HERE / f"{name}.svg"


def save_png(image: Image.Image, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Re-saving through Pillow drops renderer metadata, so reruns give identical bytes.
    image.save(path, "PNG", optimize=True)
    print(f"  {path.relative_to(HERE.parent)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--renderer", choices=("rsvg", "cairosvg"))
    args = parser.parse_args()
    render = pick_renderer(args.renderer)

    print("tray icons:")
    for state in TRAY_STATES:
        name = f"tray-{state}"
        for size in TRAY_SIZES:
            save_png(render(source_for(name, size), size), APP / f"{name}-{size}.png")

    print("app icon:")
    app = {}
    for size in sorted(set(HICOLOR_SIZES) | set(ICO_SIZES) | set(ICNS_SIZES)):
        app[size] = render(source_for(APP_NAME, size), size)
    for size in HICOLOR_SIZES:
        save_png(app[size], APP / "hicolor" / f"{size}x{size}" / "apps" / f"{APP_NAME}.png")

    ico = HERE / f"{APP_NAME}.ico"
    app[256].save(
        ico,
        format="ICO",
        sizes=[(s, s) for s in ICO_SIZES],
        append_images=[app[s] for s in ICO_SIZES if s != 256],
    )
    print(f"  {ico.relative_to(HERE.parent)}")

    icns = HERE / f"{APP_NAME}.icns"
    app[1024].save(icns, format="ICNS", append_images=[app[s] for s in ICNS_SIZES if s != 1024])
    print(f"  {icns.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
