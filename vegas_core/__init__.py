"""vegas_core: a compact PyTorch engine for Vegas self-speculative decoding.

Public API: ``load_model``, ``generate``, ``SpecConfig``, ``SpecSchedule`` and the result
types. Everything else is internal and may change.
"""

from vegas_core.config import ModelConfig
from vegas_core.errors import VegasError
from vegas_core.generation import (GenerationResult, GenerationStats, SpeculativeStats,
                                   generate)
from vegas_core.loading import LoadedModel, load_model
from vegas_core.schedule import SpecSchedule
from vegas_core.spec_config import SpecConfig

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "LoadedModel",
    "ModelConfig",
    "SpecConfig",
    "SpecSchedule",
    "SpeculativeStats",
    "VegasError",
    "generate",
    "load_model",
]
__version__ = "0.1.0"
