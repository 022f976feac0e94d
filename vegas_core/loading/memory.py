"""How much memory a model needs, checked before any of it is allocated.

A model too big for the machine otherwise ends in the kernel's out-of-memory killer
(the process vanishes without a message) or a CUDA out-of-memory error halfway through
loading. The estimate comes from the config, not the file size: a GGUF file's quantized
weights are dequantized to the compute dtype, so they grow well beyond the file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vegas_core.cache import layer_slots
from vegas_core.config import ModelConfig
from vegas_core.errors import VegasError

BYTES_PER_GIB = 2**30
MEMINFO_PATH = "/proc/meminfo"
MEMINFO_AVAILABLE = "MemAvailable"
MEMINFO_UNIT = 1024  # /proc/meminfo counts kB
# A container's memory limit is what its out-of-memory killer enforces; /proc/meminfo
# shows the whole host. (limit file, usage file, stat file, reclaimable-cache key)
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
     "/sys/fs/cgroup/memory.stat", "inactive_file"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
     "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"),
)
# cgroup v1 writes "no limit" as a number near 2**63.
CGROUP_NO_LIMIT = 2**60
# Checkpoint tensors pass through one float32 copy each (GGUF dequantizes to float32;
# safetensors hand over a tensor before it is cast), so loading needs the largest one
# on top of the weights.
STAGING_BYTES_PER_VALUE = 4
# The dtype suggested when float32 does not fit.
SMALLER_DTYPE = torch.bfloat16


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per value of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """The weights' size in ``dtype``: every parameter the config implies."""
    return config.num_parameters() * dtype_bytes(dtype)


def staging_bytes(config: ModelConfig) -> int:
    """The transient float32 copy of the largest checkpoint tensor while loading."""
    largest = max(config.vocab_size, config.intermediate_size,
                  config.num_heads * config.head_dim) * config.hidden_size
    return largest * STAGING_BYTES_PER_VALUE


def kv_cache_bytes(config: ModelConfig, dtype: torch.dtype, tokens: int, batch_size: int) -> int:
    """A preallocated K and V cache of ``tokens`` positions for ``batch_size`` sequences
    (a hybrid model's sliding layers as rings where the cache is longer than theirs)."""
    per_slot = 2 * config.num_kv_heads * config.head_dim * dtype_bytes(dtype)
    return layer_slots(config.num_layers, config.window, tokens) * per_slot * batch_size


def largest_batch_that_fits(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                            tokens: int, *, staging: bool = True) -> int | None:
    """The most sequences of ``tokens`` positions whose KV cache fits beside the weights
    in ``device``'s free memory (0: not even one); None when the free memory cannot be
    told. The same need as ``check_model_fits``: weights, the staging copy (see there)
    and the cache."""
    free = available_bytes(device)
    if free is None:
        return None
    fixed = weight_bytes(config, dtype) + (
        staging_bytes(config) if staging and device.type == "cpu" else 0)
    return max(0, (free - fixed) // kv_cache_bytes(config, dtype, tokens, 1))


def free_memory_words(device: torch.device) -> str:
    """``12.3 GiB`` free on ``device``, or ``unknown``."""
    free = available_bytes(device)
    return "unknown" if free is None else gib(free)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2): no limit


def _cgroup_available() -> int | None:
    """Room left under this process's cgroup memory limit (None: no limit found)."""
    for limit_file, usage_file, stat_file, cache_key in CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is None or usage is None or limit >= CGROUP_NO_LIMIT:
            continue
        reclaimable = 0
        try:
            for line in Path(stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key and value.strip().isdigit():
                    reclaimable = int(value)
        except OSError:
            pass
        return max(0, limit - (usage - reclaimable))
    return None


def _host_available() -> int | None:
    try:
        import psutil  # optional: not a dependency; /proc/meminfo answers without it
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open(MEMINFO_PATH, encoding="ascii") as meminfo:
            for line in meminfo:
                key, _, value = line.partition(":")
                if key == MEMINFO_AVAILABLE:
                    return int(value.split()[0]) * MEMINFO_UNIT
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(device: torch.device) -> int | None:
    """Memory free for a new model on ``device``, or None when it cannot be told.

    CPU: the host's available memory (psutil, else ``MemAvailable`` in /proc/meminfo),
    capped by the cgroup limit when the process runs in a limited container. CUDA: the
    free memory ``torch.cuda.mem_get_info`` reports for that GPU.
    """
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError, ValueError):
            return None
    if device.type != "cpu":
        return None
    known = [b for b in (_host_available(), _cgroup_available()) if b is not None]
    return min(known) if known else None


def gib(n: int) -> str:
    """``n`` bytes as ``12.3 GiB``."""
    return f"{n / BYTES_PER_GIB:.1f} GiB"


def check_model_fits(config: ModelConfig, device: torch.device, dtype: torch.dtype, *,
                     staging: bool = True, extra_bytes: int = 0, extra_what: str = "",
                     extra_fix: str = "") -> None:
    """Raise ``VegasError`` (one line) when the model will not fit in ``device``'s memory.

    The need is the weights in ``dtype``, plus the staging copy of the largest tensor
    when weights are read from a file (``staging``; on the CPU only, where they are
    staged), plus ``extra_bytes`` (``extra_what`` names them, e.g. a KV cache, and
    ``extra_fix`` says how to need less of them). Nothing is checked when the free memory
    cannot be told.
    """
    free = available_bytes(device)
    if free is None:
        return

    def need(dt: torch.dtype) -> int:
        staged = staging_bytes(config) if staging and device.type == "cpu" else 0
        return weight_bytes(config, dt) + staged + extra_bytes

    total = need(dtype)
    if total <= free:
        return
    dtype_name = str(dtype).removeprefix("torch.")
    parts = [f"weights {gib(weight_bytes(config, dtype))}"]
    if extra_bytes:
        parts.append(f"{extra_what or 'other'} {gib(extra_bytes)}")
    where = "the CPU" if device.type == "cpu" else str(device)
    if dtype_bytes(dtype) > dtype_bytes(SMALLER_DTYPE) and need(SMALLER_DTYPE) <= free:
        fix = f"use --dtype {str(SMALLER_DTYPE).removeprefix('torch.')} (about {gib(need(SMALLER_DTYPE))})"
    else:
        fix = "use a smaller model"
        if extra_fix:
            fix += f" or {extra_fix}"
    raise VegasError(
        f"{config.name} in {dtype_name} needs about {gib(total)} of memory "
        f"({', '.join(parts)}), but only {gib(free)} is free on {where}; {fix}, or run "
        f"on a machine with more memory"
    )
