"""Models you already have: GGUF files that LM Studio, Ollama and the Hugging Face cache keep.

Only finds and names them; registering one (without copying it) is the registry's job.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from app.engine.registry import models

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_PROJECTOR_LAYER = "application/vnd.ollama.image.projector"  # a vision model's projector
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Found:
    name: str      # how the other app calls it
    path: str
    size_bytes: int
    source: str    # "lmstudio" | "ollama" | "huggingface"
    projector: str | None = None  # its vision projector, registered with it (models.projector)


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _found(name: str, path: Path, source: str, projector: str | None) -> Found:
    real = path.resolve()
    return Found(name, str(real), real.stat().st_size, source, projector)


def _model(file: Path) -> bool:
    """A GGUF model file (a vision projector beside one is not a model of its own)."""
    return file.is_file() and not file.name.lower().startswith(models.PROJECTOR_PREFIX) and _is_gguf(file)


def lmstudio(home: Path) -> list[Found]:
    out = []
    for root in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        if root.is_dir():
            for file in sorted(root.rglob("*.gguf")):
                if _model(file):
                    name = file.relative_to(root).as_posix()
                    out.append(_found(name, file, "lmstudio", models.projector(file, None)))
    return out


def ollama(roots: list[Path]) -> list[Found]:
    """Ollama keeps content-addressed blobs; its manifests say which blob is which model."""
    out = []
    for root in roots:
        manifests = root / "manifests"
        if not manifests.is_dir():
            continue
        for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
            try:
                layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
            except (OSError, ValueError, AttributeError):
                continue
            blob, projector = (_blob(root, layers, kind) for kind in (OLLAMA_MODEL_LAYER, OLLAMA_PROJECTOR_LAYER))
            if blob is None:
                continue
            parts = manifest.relative_to(manifests).parts  # host / namespace / model / tag
            if len(parts) < 3:
                continue
            namespace, model, tag = parts[-3], parts[-2], parts[-1]
            name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
            vision = str(projector.resolve()) if projector and models.is_projector(projector) else None
            out.append(_found(name, blob, "ollama", vision))
    return out


def _blob(root: Path, layers: list[object], kind: str) -> Path | None:
    """The GGUF blob of a manifest's layer of this media type, if it has one."""
    layer = next((x for x in layers if isinstance(x, dict) and x.get("mediaType") == kind), None)
    digest = str(layer.get("digest", "")) if isinstance(layer, dict) else ""
    blob = root / "blobs" / digest.replace(":", "-")
    return blob if digest.startswith("sha256:") and blob.is_file() and _is_gguf(blob) else None


def huggingface(hub: Path) -> list[Found]:
    out: list[Found] = []
    if not hub.is_dir():
        return out
    for repo in sorted(hub.glob("models--*")):
        repo_name = repo.name[len("models--"):].replace("--", "/")
        for file in sorted((repo / "snapshots").glob("*/**/*.gguf")):
            if _model(file):
                name = f"{repo_name}/{'/'.join(file.relative_to(repo / 'snapshots').parts[1:])}"
                out.append(_found(name, file, "huggingface", models.projector(file, None)))
    return out


def hub_cache(home: Path | None = None, env: dict[str, str] | None = None) -> Path:
    """The Hugging Face hub cache, where huggingface_hub reads and writes models: an absolute path
    (a relative HF_HOME, from the folder the app started in, made every download fail once done:
    a model is registered by its absolute path)."""
    home = home or Path.home()
    env = dict(os.environ) if env is None else env
    hf_home = Path(env.get("HF_HOME") or home / ".cache" / "huggingface")
    return Path(env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or hf_home / "hub").absolute()


def discover(home: Path | None = None, env: dict[str, str] | None = None) -> list[Found]:
    """Everything found in the usual places, each file once."""
    home = home or Path.home()
    env = dict(os.environ) if env is None else env
    ollama_roots = [Path(env["OLLAMA_MODELS"])] if env.get("OLLAMA_MODELS") else []
    ollama_roots += [home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    hub = hub_cache(home, env)
    seen: set[str] = set()
    result = []
    for item in lmstudio(home) + ollama(ollama_roots) + huggingface(hub):
        if item.path not in seen:
            seen.add(item.path)
            result.append(item)
    return result
