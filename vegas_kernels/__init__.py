"""Triton kernels (verify attention with fused selection scores, sparse draft attention,
the top-k of the prefix slots), each beside its PyTorch reference. The engine's
reference path lives in ``vegas_core.attention``; attention kernels plug in behind
``vegas_core.attention.attend``, the top-k behind ``vegas_core.selection``.

Named ``vegas_kernels``, not ``kernels``: transformers (5.25 and later) depends on the
Hugging Face package ``kernels``, and a top-level ``kernels`` of ours would shadow it (and
share its folder in site-packages)."""
