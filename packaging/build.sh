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

# A build to hand out carries llama.cpp for every x86-64 CPU: one libggml-cpu-<variant> per
# instruction-set level, the best loaded at run time (GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS;
# the Makefile builds llama-cpp-python so). pip's default build is native: a single
# libggml-cpu for this machine's CPU, which dies with "illegal instruction" on older CPUs.
variants_dir="$("$PYTHON" -c 'from app.engine.child import backend; print(backend.variants_dir() or "")')"
variants=""
[ -z "$variants_dir" ] || variants="$(cd "$variants_dir" && ls | grep -E '^libggml-cpu-[a-z0-9_]+\.(so|dylib|dll)$' | sort)"
if [ -z "$variants_dir" ] && [ "$(uname -m)" = x86_64 ]; then  # (other CPUs: not set up here yet)
  echo "build.sh: llama-cpp-python in $PYTHON is a NATIVE build (one libggml-cpu for this CPU only):" \
       "the app would crash on CPUs that lack this one's instructions. Install the portable build" \
       "(make .venv/bin/.installed; packaging/README.md), or set LMSP_ALLOW_NATIVE=1 for a build" \
       "that is only for this machine." >&2
  [ "${LMSP_ALLOW_NATIVE:-}" = 1 ] || exit 1
  echo "build.sh: WARNING: LMSP_ALLOW_NATIVE=1: building with the native llama.cpp anyway" >&2
fi

started=$(date +%s)
"$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
  --distpath "$ROOT/dist" --workpath "$ROOT/build/pyinstaller" "$ROOT/packaging/lmsp-tray.spec"
elapsed=$(( $(date +%s) - started ))

app="$ROOT/dist/lmsp-tray"
echo "built $app in ${elapsed}s"
echo "size: $(du -sh "$app" | cut -f1)"
for variant in $variants; do  # every CPU variant made it into the bundle, beside libllama
  [ -f "$app/_internal/llama_cpp/lib/$variant" ] || { echo "build.sh: $variant is missing from the build" >&2; exit 1; }
done
[ -z "$variants" ] || echo "llama.cpp CPU variants:" $(echo "$variants" | sed -E 's/^libggml-cpu-//; s/\.[a-z]+$//')
if [ -d "$ROOT/dist/LMSP Tray.app" ]; then
  echo "macOS bundle: $ROOT/dist/LMSP Tray.app ($(du -sh "$ROOT/dist/LMSP Tray.app" | cut -f1))"
fi
