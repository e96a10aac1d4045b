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

# llama.cpp as `make` builds it (LMSP_LLAMA_SERVER, else the one app/paths.py finds: .venv's link,
# the build folder): `llama-server` with its libraries beside it, every x86-64 CPU variant among
# them (libggml-cpu-<variant>, the best one loaded at run time: GGML_BACKEND_DL). The spec copies
# that folder into the bundle's llama.cpp/.
server="$("$PYTHON" -c 'from app import paths; print(paths.llama_server() or "")')"
if [ -z "$server" ]; then
  echo "build.sh: no llama-server; 'make llama-server' builds it (or set LMSP_LLAMA_SERVER)" >&2
  exit 1
fi
llama_dir="$(dirname "$(readlink -f "$server")")"
variants="$(cd "$llama_dir" && ls | grep -E '^libggml-cpu-[a-z0-9_]+\.(so|dylib|dll)$' | sort)"
if [ -z "$variants" ] && [ "$(uname -m)" = x86_64 ]; then  # (other CPUs: not set up here yet)
  echo "build.sh: $llama_dir has no libggml-cpu-<variant> libraries: a native llama.cpp build, for" \
       "this CPU only, would crash on CPUs that lack its instructions. Build the portable one" \
       "(make llama-server; packaging/README.md), or set LMSP_ALLOW_NATIVE=1 for a build that is" \
       "only for this machine." >&2
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
for file in llama-server $variants; do  # the program and every CPU variant made it into the bundle
  [ -f "$app/_internal/llama.cpp/$file" ] || { echo "build.sh: llama.cpp/$file is missing from the build" >&2; exit 1; }
done
[ -z "$variants" ] || echo "llama.cpp CPU variants:" $(echo "$variants" | sed -E 's/^libggml-cpu-//; s/\.[a-z]+$//')
if [ -d "$ROOT/dist/LMSP Tray.app" ]; then
  echo "macOS bundle: $ROOT/dist/LMSP Tray.app ($(du -sh "$ROOT/dist/LMSP Tray.app" | cut -f1))"
fi
