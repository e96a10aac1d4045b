"""Models people already have: LM Studio's folder, Ollama's blob store, the Hugging Face cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.core.service import AppService
from app.engine.registry.discovery import discover
from app.errors import InvalidRequest
from tests.test_gguf import make_gguf

GGUF = make_gguf({"general.architecture": "llama", "general.name": "Tiny", "llama.context_length": 256})


def _write(path: Path, data: bytes = GGUF) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _machine(home: Path) -> dict[str, Path]:
    """A home folder laid out as the three apps lay theirs out, with small files made here."""
    lms = _write(home / ".lmstudio/models/bartowski/Tiny-GGUF/tiny-Q4_K_M.gguf")
    _write(home / ".lmstudio/models/bartowski/Tiny-GGUF/README.md", b"not a model")
    _write(home / ".lmstudio/models/other/fake.gguf", b"this is no gguf at all")  # named .gguf, isn't one
    blob_hex = "ab" * 32
    blob = _write(home / f".ollama/models/blobs/sha256-{blob_hex}")
    _write(home / f".ollama/models/blobs/sha256-{'cd' * 32}", b'{"template": "..."}')
    manifest = {"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + blob_hex}]}
    _write(home / ".ollama/models/manifests/registry.ollama.ai/library/tiny/latest", json.dumps(manifest).encode())
    other_hex = "ef" * 32
    _write(home / f".ollama/models/blobs/sha256-{other_hex}")
    other = {"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + other_hex}]}
    _write(home / ".ollama/models/manifests/registry.ollama.ai/someone/tiny-chat/q4", json.dumps(other).encode())
    # A second name for the same blob: one file, listed once.
    _write(home / ".ollama/models/manifests/registry.ollama.ai/library/tiny/v2", json.dumps(manifest).encode())
    _write(home / ".ollama/models/manifests/registry.ollama.ai/library/broken/latest", b"{not json")
    hf_blob = _write(home / ".cache/huggingface/hub/models--TheOrg--Tiny-GGUF/blobs/0123abcd")
    link = home / ".cache/huggingface/hub/models--TheOrg--Tiny-GGUF/snapshots/rev1/tiny.Q8_0.gguf"
    link.parent.mkdir(parents=True)
    link.symlink_to(hf_blob)
    return {"lmstudio": lms, "ollama": blob, "huggingface": hf_blob}


def test_finds_the_models_of_all_three_apps_by_their_names(tmp_path: Path) -> None:
    files = _machine(tmp_path)
    found = {f.name: f for f in discover(home=tmp_path, env={})}
    assert set(found) == {"bartowski/Tiny-GGUF/tiny-Q4_K_M.gguf", "tiny:latest", "someone/tiny-chat:q4",
                          "TheOrg/Tiny-GGUF/tiny.Q8_0.gguf"}
    assert found["tiny:latest"].path == str(files["ollama"].resolve())  # the blob itself, not a copy
    assert found["TheOrg/Tiny-GGUF/tiny.Q8_0.gguf"].path == str(files["huggingface"].resolve())
    assert {f.source for f in found.values()} == {"lmstudio", "ollama", "huggingface"}
    assert all(f.size_bytes == len(GGUF) for f in found.values())


def test_environment_overrides_are_followed(tmp_path: Path) -> None:
    files = _machine(tmp_path / "elsewhere")
    found = discover(home=tmp_path, env={"OLLAMA_MODELS": str(tmp_path / "elsewhere/.ollama/models"),
                                         "HF_HUB_CACHE": str(tmp_path / "elsewhere/.cache/huggingface/hub")})
    assert {f.source for f in found} == {"ollama", "huggingface"}
    assert str(files["ollama"].resolve()) in {f.path for f in found}


def test_an_empty_home_finds_nothing(tmp_path: Path) -> None:
    assert discover(home=tmp_path, env={}) == []


async def test_picked_models_are_registered_in_place(service: AppService, tmp_path: Path,
                                                     monkeypatch: object) -> None:
    home = tmp_path / "home"
    files = _machine(home)
    monkeypatch.setattr("app.engine.registry.discovery.Path.home", lambda: home)  # type: ignore[attr-defined]
    offered = await service.models.discover_models()
    ollama = next(m for m in offered if m["name"] == "tiny:latest")
    assert ollama["registered"] is False and ollama["suggested_id"] == "tiny:latest"
    model = await service.models.register_model({"path": ollama["path"], "id": ollama["suggested_id"]})
    assert model["path"] == str(files["ollama"].resolve()) and model["digest"].startswith("sha256:")
    assert len(list((home / ".ollama/models/blobs").iterdir())) == 3  # nothing copied
    again = {m["name"]: m for m in await service.models.discover_models()}
    assert again["tiny:latest"]["registered"] is True


async def test_a_vision_projector_is_found_beside_its_model_or_in_its_manifest(service: AppService,
                                                                               tmp_path: Path) -> None:
    """LM Studio keeps `mmproj-*.gguf` beside the model (not a model of its own), Ollama a
    projector layer in the manifest: either is registered with the model, which then shows it."""
    files = _machine(tmp_path)
    projector = make_gguf({"general.architecture": "clip", "clip.has_vision_encoder": True})
    beside = _write(files["lmstudio"].parent / "mmproj-tiny-f16.gguf", projector)
    _write(files["lmstudio"].parent / "mmproj-broken.gguf", GGUF)  # a text model so named: passed over
    layer = _write(tmp_path / f".ollama/models/blobs/sha256-{'77' * 32}", projector)
    vision = _write(tmp_path / f".ollama/models/blobs/sha256-{'88' * 32}")
    manifest = {"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "88" * 32},
                           {"mediaType": "application/vnd.ollama.image.projector", "digest": "sha256:" + "77" * 32}]}
    _write(tmp_path / ".ollama/models/manifests/registry.ollama.ai/library/tiny-vision/latest",
           json.dumps(manifest).encode())
    found = {f.name: f for f in discover(home=tmp_path, env={})}
    assert not any("mmproj" in name for name in found)
    assert found["bartowski/Tiny-GGUF/tiny-Q4_K_M.gguf"].projector == str(beside.resolve())
    assert found["tiny-vision:latest"].projector == str(layer.resolve())
    assert found["tiny:latest"].projector is None and found["TheOrg/Tiny-GGUF/tiny.Q8_0.gguf"].projector is None
    model = await service.models.register_model({"path": str(files["lmstudio"]), "id": "tiny-lms"})
    assert model["projector"] == str(beside)
    model = await service.models.register_model({"path": str(vision), "id": "tiny-vision",
                                                 "projector": found["tiny-vision:latest"].projector})
    assert model["projector"] == str(layer.resolve())
    with pytest.raises(InvalidRequest) as refused:  # a text model is no projector
        await service.models.register_model({"path": str(files["ollama"]), "id": "bad",
                                             "projector": str(files["ollama"])})
    assert refused.value.param == "projector" and refused.value.code == "invalid_model_file"
