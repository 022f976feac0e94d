"""What the tuner ran on: a hardware fingerprint for profiles and a short name for paths.

A profile is only valid for the hardware it was tuned on, so the profile records the GPU,
driver and software versions, and its path carries ``gpu_slug`` (``h200``, ``h200x2``).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess

import torch

from vegas_core.errors import VegasError

DRIVER_QUERY = ("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
# nvidia-smi can hang on a wedged driver; the fingerprint must not.
DRIVER_QUERY_TIMEOUT_S = 10
BYTES_PER_GB = 2**30  # GiB, as torch reports total_memory in bytes
CPUINFO_PATH = "/proc/cpuinfo"
CPU_SLUG = "cpu"
VENDOR_PREFIX = "nvidia "
FINGERPRINT_KEYS = ("gpu_name", "gpu_count", "gpu_memory_gb", "driver", "cuda", "torch",
                    "triton", "cpu", "cpu_count")


def fingerprint(device: str = "auto") -> dict:
    """The hardware and software the tuner runs on, as plain data for a profile.

    Keys: ``gpu_name``, ``gpu_count`` (visible CUDA devices), ``gpu_memory_gb`` (GiB,
    one decimal), ``driver`` (from ``nvidia-smi``), ``cuda`` and ``torch`` (the torch
    build), ``triton`` (None if not installed), ``cpu`` and ``cpu_count``.
    ``device`` is ``auto`` (the GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N``;
    with no GPU in use the GPU fields are None and ``gpu_count`` is 0.
    """
    use_gpu = _uses_gpu(device)
    gpu_name = gpu_memory_gb = driver = None
    gpu_count = 0
    if use_gpu:
        index = torch.device(device).index if device.startswith("cuda") else None
        index = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(index)
        gpu_name = props.name
        gpu_count = torch.cuda.device_count()
        gpu_memory_gb = round(props.total_memory / BYTES_PER_GB, 1)
        driver = _driver_version()
    return {
        "gpu_name": gpu_name,
        "gpu_count": gpu_count,
        "gpu_memory_gb": gpu_memory_gb,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }


def gpu_slug(fp: dict) -> str:
    """A short, filesystem-safe hardware name for profile paths.

    ``cpu`` without a GPU; else the GPU name in lower case without ``NVIDIA``, spaces and
    punctuation as ``-`` (``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``), plus
    ``x<N>`` for N > 1 GPUs (``h200x2``).
    """
    name, count = fp.get("gpu_name"), fp.get("gpu_count") or 0
    if not name or count < 1:
        return CPU_SLUG
    name = name.strip().lower()
    if name.startswith(VENDOR_PREFIX):
        name = name[len(VENDOR_PREFIX):]
    # Anything but letters and digits becomes one "-", so the slug is safe in any path.
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"
    return f"{slug}x{count}" if count > 1 else slug


def _uses_gpu(device: str) -> bool:
    if device == "auto":
        return torch.cuda.is_available()
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise VegasError(f"device '{device}' needs CUDA, which this machine lacks; "
                             "use --device cpu")
        return True
    return False


def _driver_version() -> str | None:
    """The NVIDIA driver version, or None when nvidia-smi is missing or fails."""
    if shutil.which(DRIVER_QUERY[0]) is None:
        return None
    try:
        result = subprocess.run(DRIVER_QUERY, capture_output=True, text=True,
                                timeout=DRIVER_QUERY_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = result.stdout.strip().splitlines()
    # One line per GPU; a host has one driver, so the first line says it.
    return lines[0].strip() if lines and lines[0].strip() else None


def _triton_version() -> str | None:
    try:
        import triton  # optional: the GPU kernels need it, this check does not
    except Exception:  # not installed, or a broken install: either way, not usable
        return None
    return getattr(triton, "__version__", None)


def _cpu_model() -> str:
    try:
        with open(CPUINFO_PATH, encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass  # not Linux: fall back to what platform knows
    return platform.processor() or platform.machine()
