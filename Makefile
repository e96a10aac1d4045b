# The two commands of README.md:  `make run`  and  `make test`.
# Both create .venv and install what they need; the first install compiles llama.cpp
# (llama-cpp-python, about 9 minutes on 2 cores; pip caches the wheel afterwards).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Qt's platform plugins and the virtual screen + tray host the GUI tests use.
APT_PACKAGES := xvfb trayer xdotool x11-utils imagemagick libxcb-cursor0 libxkbcommon-x11-0 \
  libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0 libxcb-render-util0 libxcb-shape0 \
  libxcb-xinerama0 libxcb-xkb1 libegl1 libgl1 libdbus-1-3 libfontconfig1 cmake build-essential \
  desktop-file-utils appstream

.PHONY: run test bench package system-deps clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install -e '.[test]'
	touch $@

system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

run: system-deps $(BIN)/.installed
	$(BIN)/lmsp-tray

test: system-deps $(BIN)/.installed
	$(BIN)/python -m pytest -q

bench: system-deps $(BIN)/.installed
	$(BIN)/python -m pytest -q -s tests/bench

# The one-folder desktop app in dist/lmsp-tray/ (PyInstaller; packaging/README.md).
package: system-deps $(BIN)/.installed
	packaging/build.sh

clean:
	rm -rf $(VENV) build dist *.egg-info
