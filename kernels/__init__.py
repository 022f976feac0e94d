"""Triton kernels (verify attention with fused selection scores, sparse draft attention),
each beside its PyTorch reference. The engine's reference path lives in
``vegas_core.attention``; kernels plug in behind ``vegas_core.attention.attend``."""
