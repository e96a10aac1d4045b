# The two commands of README.md:  `make run`  and  `make test`.
# Both create .venv and install what they need. The first install on a machine compiles
# llama.cpp (llama-cpp-python) once, portable: every x86-64 CPU variant, the best one picked
# at run time (GGML_BACKEND_DL), so the venv, the wheel and the frozen app run on any CPU.
# The wheel is kept in $(WHEELS) and reused by every later install.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
LLAMA_VERSION := 0.3.36
LLAMA_CMAKE   := -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON
WHEELS        ?= $(HOME)/.cache/lmsp-tray/wheels/llama-$(LLAMA_VERSION)-portable
LLAMA_WHEEL   := $(WHEELS)/.built

# Qt's platform plugins and the virtual screen + tray host the GUI tests use.
APT_PACKAGES := xvfb trayer xdotool x11-utils imagemagick libxcb-cursor0 libxkbcommon-x11-0 \
  libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0 libxcb-render-util0 libxcb-shape0 \
  libxcb-xinerama0 libxcb-xkb1 libegl1 libgl1 libdbus-1-3 libfontconfig1 cmake build-essential \
  desktop-file-utils appstream

.PHONY: run test bench package system-deps clean

# --no-cache-dir: pip's own wheel cache does not know CMAKE_ARGS and could hand back a
# native build made elsewhere.
$(LLAMA_WHEEL):
	mkdir -p $(WHEELS)
	CMAKE_ARGS="$(LLAMA_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PYTHON) -m pip wheel --no-deps \
	  --no-cache-dir --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_VERSION) -w $(WHEELS)
	touch $@

$(BIN)/.installed: pyproject.toml $(LLAMA_WHEEL)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --find-links $(WHEELS) -e '.[test]' llama-cpp-python==$(LLAMA_VERSION)
	touch $@

system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

run: system-deps $(BIN)/.installed
	$(BIN)/lmsp-tray

# tests/test_wheel.py installs the app's wheel in a fresh venv, with llama.cpp from $(WHEELS).
test: system-deps $(BIN)/.installed
	LMSP_WHEELS=$(WHEELS) $(BIN)/python -m pytest -q

bench: system-deps $(BIN)/.installed
	$(BIN)/python -m pytest -q -s tests/bench

# The one-folder desktop app in dist/lmsp-tray/ (PyInstaller; packaging/README.md).
package: system-deps $(BIN)/.installed
	packaging/build.sh

clean:
	rm -rf $(VENV) build dist *.egg-info
