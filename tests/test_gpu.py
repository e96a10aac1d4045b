"""The GPU (LMSP §18) for real: the build's Vulkan backend on Mesa's lavapipe, a Vulkan device that
runs on the CPU (`mesa-vulkan-drivers`, which `make test` installs). llama.cpp skips Vulkan devices
of the CPU type unless GGML_VK_VISIBLE_DEVICES names them, so every other test runs on the CPU as a
machine without a GPU does, and these name lavapipe (device 0). A model on it streams, is cancelled,
survives the app's SIGKILL, and falls back to the CPU when the GPU fails (LMSP_ENGINE_FAULT's `gpu`
scope kills the server only while it has layers on a GPU, as a lost device or one out of memory
ends it). Lavapipe is slow (about 2 tokens/s, and 10-20 s to load the default model, its shaders
compiled at first use): few tokens, patient timeouts.
"""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from app.engine.parent import gpu, server
from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.conftest import LLAMA_SERVER, Headless, Processes, Upstream
from tests.helpers import COUNT, pair_sync, wait_until
from tests.test_terminal import output as printed_by

# `alone`: lavapipe decodes 2 tokens/s on an idle machine; beside three other test workers a load and
# a prompt took minutes.
pytestmark = [pytest.mark.llama, pytest.mark.gpu, pytest.mark.linux, pytest.mark.alone]
LAVAPIPE = {"GGML_VK_VISIBLE_DEVICES": "0"}
SLOW = 300.0
LOAD = f"/v1/models/{DEFAULT_MODEL_ID}/load"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def environment(**more: str) -> dict[str, str]:
    return {**os.environ, **LAVAPIPE, **more}


def on_lavapipe(data_dir: Path, procs: Processes, **more: str) -> Headless:
    return Headless(data_dir, procs, env=environment(**more)).start(timeout=120)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Headless]:
    procs = Processes()
    try:
        yield on_lavapipe(tmp_path_factory.mktemp("gpu") / "data", procs)
    finally:
        procs.close()


def model(app: Headless) -> dict[str, Any]:
    status, found = app.get(f"/v1/models/{DEFAULT_MODEL_ID}")
    assert status == 200, found
    return found  # type: ignore[no-any-return]


def sdk(app: Headless) -> openai.OpenAI:
    _, token = pair_sync(app.url, app.token, ["responses:write", "responses:read"], "gpu")
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=token, max_retries=0, timeout=SLOW)


def run(app: Headless, body: dict[str, Any]) -> dict[str, Any]:
    """A background task of `body`, once it has ended."""
    status, created = app.post("/v1/responses", {"model": DEFAULT_MODEL_ID, "background": True, **body})
    assert status == 202, created
    return ended(app, created["task"]["id"])


def ended(app: Headless, task_id: str) -> dict[str, Any]:
    return wait_until(lambda: (t := app.get(f"/v1/tasks/{task_id}")[1])["status"] in ("completed", "failed",
                                                                                      "cancelled") and t,
                      timeout=SLOW, interval=0.2, what=f"task {task_id} to end")  # type: ignore[no-any-return]


def test_the_build_has_a_vulkan_backend_that_a_machine_without_a_gpu_never_uses() -> None:
    listed = subprocess.run([str(LLAMA_SERVER), "--list-devices"], env=environment(), capture_output=True,
                            text=True, timeout=120, check=True).stdout
    [device] = gpu.read_devices(listed)
    assert device.name == "Vulkan0" and "llvmpipe" in device.description and device.free_bytes > 0, listed
    # Without the variable lavapipe is skipped, as llama.cpp skips every CPU-type device: no GPU.
    plain = {k: v for k, v in os.environ.items() if k not in LAVAPIPE}
    listed = subprocess.run([str(LLAMA_SERVER), "--list-devices"], env=plain, capture_output=True, text=True,
                            timeout=120, check=True).stdout
    assert gpu.read_devices(listed) == [] and "(none)" in listed, listed


def test_where_the_layers_go_is_passed_explicitly() -> None:
    launch = server.Launch("m.gguf", "m", 2048, 1, 2, False)
    assert launch.gpu_layers == 0 and not launch.on_gpu
    flags = server.arguments("llama-server", launch, "s.sock")
    assert flags[flags.index("--device") + 1] == "none" and flags[flags.index("--n-gpu-layers") + 1] == "0"
    fitted = server.arguments("llama-server", server.Launch("m.gguf", "m", 2048, 1, 2, False, gpu_layers=None), "s")
    assert fitted[fitted.index("--n-gpu-layers") + 1] == "auto" and fitted[fitted.index("--fit") + 1] == "on"
    assert fitted[fitted.index("--fit-target") + 1] == str(gpu.FIT_MARGIN_MIB) and "--device" not in fitted
    ten = server.arguments("llama-server", server.Launch("m.gguf", "m", 2048, 1, 2, False, gpu_layers=10), "s")
    assert ten[ten.index("--n-gpu-layers") + 1] == "10" and ten[ten.index("--fit") + 1] == "off"


def test_a_model_on_the_gpu_streams_and_says_where_it_runs_everywhere(app: Headless) -> None:
    status, loaded = app.post(LOAD, None)
    assert status == 200, loaded
    where = loaded["processor"]
    assert where["device"] == "Vulkan0" and where["gpu_layers"] == where["layers"] == 31, where
    assert where["vram_bytes"] >= loaded["memory"]["kv_cache_bytes"] > 0, where  # the KV cache is on it too
    with sdk(app) as client:
        deltas = [e.delta for e in client.responses.create(model=DEFAULT_MODEL_ID, input=CAPITAL, temperature=0,
                                                           max_output_tokens=7, stream=True)
                  if e.type == "response.output_text.delta"]
        whole = client.responses.create(model=DEFAULT_MODEL_ID, input=CAPITAL, temperature=0, max_output_tokens=7)
    # Streamed token by token, the same greedy answer as whole ("The capital of France is Paris" here).
    assert len(deltas) >= 5 and "".join(deltas) == whole.output_text, (deltas, whole.output_text)
    [line] = printed_by(app.data_dir, "ps").splitlines()[1:]
    assert "100% GPU" in line, line
    assert app.request("PATCH", "/v1/settings", {"ollama_api": "token"})[0] == 200
    [running] = app.get("/api/ps")[1]["models"]
    assert running["size_vram"] == running["size"] > 0, running


def test_greedy_text_on_the_gpu_differs_from_the_cpus_only_as_float_sums_explain(
        app: Headless, tmp_path: Path, procs: Processes, monkeypatch: pytest.MonkeyPatch) -> None:
    with sdk(app) as client:
        on_gpu = client.responses.create(model=DEFAULT_MODEL_ID, input=CAPITAL, temperature=0,
                                         max_output_tokens=8).output_text
        assert app.request("PATCH", "/v1/settings", {"gpu": "off"})[0] == 200
        try:
            on_cpu = client.responses.create(model=DEFAULT_MODEL_ID, input=CAPITAL, temperature=0,
                                             max_output_tokens=8).output_text
            assert model(app)["processor"] == {"device": "CPU", "gpu_layers": 0, "layers": 31, "vram_bytes": 0}
        finally:
            assert app.request("PATCH", "/v1/settings", {"gpu": "auto"})[0] == 200
    # The first token's three likeliest, on each device, from the bare build: the same three, each
    # as likely within a few hundredths (float sums in another order), and each device's answer
    # opens with its own likeliest, where two are that close (0.147 and 0.134 here) either may win.
    for name, value in LAVAPIPE.items():
        monkeypatch.setenv(name, value)
    fixed = ("--jinja", "--fit", "off", "--no-warmup")
    bare = {device: Upstream(procs, tmp_path / f"{device}.log", options=(*fixed, *options)).start()
            for device, options in (("GPU", ("--n-gpu-layers", "99")), ("CPU", ("--device", "none",
                                                                             "--n-gpu-layers", "0")))}
    first: dict[str, dict[str, float]] = {}
    for device, upstream in bare.items():
        with openai.OpenAI(base_url=upstream.ready(timeout=SLOW).base_url, api_key="-", timeout=SLOW) as peer:
            made = peer.chat.completions.create(model="smollm2", messages=CAPITAL,  # type: ignore[arg-type]
                                                max_tokens=1, temperature=0, logprobs=True, top_logprobs=3)
        assert made.choices[0].logprobs and made.choices[0].logprobs.content
        first[device] = {c.token: math.exp(c.logprob) for c in made.choices[0].logprobs.content[0].top_logprobs}
    assert first["GPU"].keys() == first["CPU"].keys(), first
    assert all(abs(first["GPU"][t] - first["CPU"][t]) < 0.03 for t in first["GPU"]), first
    for device, text in (("GPU", on_gpu), ("CPU", on_cpu)):
        assert text.startswith(max(first[device], key=first[device].__getitem__)), (device, text, first)
    print(f"greedy, 8 tokens: GPU {on_gpu!r}, CPU {on_cpu!r}; first token's three likeliest: {first}")


def test_a_task_on_the_gpu_is_cancelled_and_survives_a_sigkill(app: Headless) -> None:
    status, created = app.post("/v1/responses", {"model": DEFAULT_MODEL_ID, "input": COUNT, "background": True,
                                                 "max_output_tokens": 200, "temperature": 0})
    assert status == 202, created
    task_id = created["task"]["id"]
    wait_until(lambda: app.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] >= 2, timeout=SLOW,
               interval=0.2, what="two tokens")
    assert app.post(f"/v1/tasks/{task_id}/cancel", {})[0] in (200, 202)
    assert ended(app, task_id)["status"] == "cancelled"

    status, created = app.post("/v1/responses", {"model": DEFAULT_MODEL_ID, "input": COUNT, "background": True,
                                                 "max_output_tokens": 10, "temperature": 0, "on_restart": "resume"})
    assert status == 202, created
    task_id = created["task"]["id"]
    wait_until(lambda: app.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] >= 3, timeout=SLOW,
               interval=0.2, what="three tokens")
    before = app.get(f"/v1/responses/{created['id']}")[1]["output_text"]
    app.kill()  # the app's llama-server goes with it
    app.start(timeout=120)
    done = ended(app, task_id)
    assert done["status"] == "completed", done
    after = app.get(f"/v1/responses/{created['id']}")[1]["output_text"]
    assert before and after.startswith(before), (before, after)
    assert model(app)["processor"]["device"] == "Vulkan0"  # resumed on the GPU again


def test_a_load_that_fails_on_the_gpu_runs_on_the_cpu_remembered_until_asked_again(
        tmp_path: Path, procs: Processes) -> None:
    data = tmp_path / "data"
    app = on_lavapipe(data, procs, LMSP_ENGINE_FAULT="gpu:warmup:SIGABRT")
    status, loaded = app.post(LOAD, None)
    assert status == 200 and loaded["processor"]["device"] == "CPU", loaded
    engine = loaded["engine"]
    assert engine["gpu"] == "off" and "SIGABRT" in engine["gpu_reason"] and "CPU" in engine["gpu_reason"], engine
    assert run(app, {"input": "Say hi", "max_output_tokens": 3})["status"] == "completed"
    app.terminate()
    app = on_lavapipe(data, procs, LMSP_ENGINE_FAULT="gpu:warmup:SIGABRT")
    assert model(app)["engine"]["gpu_reason"] == engine["gpu_reason"]  # remembered: no crash at each load
    assert app.post(LOAD, None)[1]["processor"]["device"] == "CPU"
    assert app.log.read_text().count("failed on the GPU") == 1
    status, again = app.request("DELETE", f"/v1/models/{DEFAULT_MODEL_ID}/engine-mode")
    assert status == 200 and again["engine"]["gpu"] == "auto" and again["engine"]["gpu_reason"] is None, again


def test_a_gpu_lost_mid_task_moves_its_tasks_by_their_on_restart_and_the_model_to_the_cpu(
        tmp_path: Path, procs: Processes) -> None:
    app = on_lavapipe(tmp_path / "data", procs, LMSP_ENGINE_FAULT="gpu:token2:SIGABRT")
    assert app.post(LOAD, None)[1]["processor"]["device"] == "Vulkan0"
    failing = app.post("/v1/responses", {"model": DEFAULT_MODEL_ID, "input": COUNT, "background": True,
                                         "max_output_tokens": 6, "temperature": 0, "on_restart": "fail"})[1]
    resuming = app.post("/v1/responses", {"model": DEFAULT_MODEL_ID, "input": COUNT, "background": True,
                                          "max_output_tokens": 6, "temperature": 0, "on_restart": "resume"})[1]
    failed, resumed = ended(app, failing["task"]["id"]), ended(app, resuming["task"]["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_crashed", failed
    assert resumed["status"] == "completed", resumed
    found = model(app)
    assert found["processor"]["device"] == "CPU" and "SIGABRT" in found["engine"]["gpu_reason"], found
    assert app.log.read_text().count("failed on the GPU") == 1  # said once, though two tasks saw it


def test_a_load_may_ask_for_some_layers_on_the_gpu(app: Headless) -> None:
    status, loaded = app.post(LOAD, {"gpu_layers": 10})
    assert status == 200 and loaded["processor"]["gpu_layers"] == 10 and loaded["processor"]["layers"] == 31, loaded
    [line] = printed_by(app.data_dir, "ps").splitlines()[1:]
    assert "68%/32% CPU/GPU" in line, line
    status, error = app.post(LOAD, {"gpu_layers": -1})
    assert status == 400 and error["error"]["param"] == "gpu_layers", error
    assert app.post(LOAD, {"gpu_layers": None})[1]["processor"]["gpu_layers"] == 31
