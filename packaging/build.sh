#!/usr/bin/env bash
# Build the one-folder desktop app into dist/lmsp-tray/ (PyInstaller, packaging/lmsp-tray.spec).
#
#   packaging/build.sh            # uses .venv (make run / make test create it)
#   PYTHON=/path/to/python packaging/build.sh
#
# Run dist/lmsp-tray/lmsp-tray; install it in the desktop's menu with
# packaging/linux/install-desktop.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"

if [ ! -x "$PYTHON" ]; then
  echo "build.sh: no Python at $PYTHON; run 'make test' (or 'make run') first to create .venv" >&2
  exit 1
fi
if ! "$PYTHON" -c 'import PyInstaller' >/dev/null 2>&1; then
  echo "build.sh: installing PyInstaller into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
  "$PYTHON" -m pip install --quiet 'pyinstaller>=6'
fi

started=$(date +%s)
"$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
  --distpath "$ROOT/dist" --workpath "$ROOT/build/pyinstaller" "$ROOT/packaging/lmsp-tray.spec"
elapsed=$(( $(date +%s) - started ))

app="$ROOT/dist/lmsp-tray"
echo "built $app in ${elapsed}s"
echo "size: $(du -sh "$app" | cut -f1)"
# llama-cpp-python compiles llama.cpp for the CPU it is installed on (GGML_NATIVE): a build
# that uses AVX-512 stops with "illegal instruction" on the many CPUs without it.
cpu_lib="$(ls "$app"/_internal/llama_cpp/lib/libggml-cpu.so* 2>/dev/null | head -n 1 || true)"
if [ -n "$cpu_lib" ] && command -v objdump >/dev/null 2>&1 \
   && [ "$(objdump -d --no-show-raw-insn "$cpu_lib" | grep -c '%zmm' || true)" -gt 0 ]; then
  echo "warning: llama.cpp in this build uses AVX-512 (compiled for this machine's CPU); it will" \
       "not run on CPUs without it. For a build to hand out, see packaging/README.md (GGML_NATIVE)." >&2
fi
if [ -d "$ROOT/dist/LMSP Tray.app" ]; then
  echo "macOS bundle: $ROOT/dist/LMSP Tray.app ($(du -sh "$ROOT/dist/LMSP Tray.app" | cut -f1))"
fi
