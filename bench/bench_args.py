"""Command-line options several benches share, so that they read alike everywhere: the
model and where it runs, long-generation spans, and where results go."""

from __future__ import annotations

import argparse
from pathlib import Path

from vegas_tune.spans import DEFAULT_SPAN_TOKENS, SPAN_WARMUP_ITERATIONS


def add_model_args(p: argparse.ArgumentParser, dtype: str) -> None:
    """--model, --device and --dtype (default ``dtype``)."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=dtype)


def add_span_args(p: argparse.ArgumentParser, spans_help: str) -> None:
    """--spans (0: decode every token), --span-tokens and --span-warmup."""
    p.add_argument("--spans", type=int, default=0, help=spans_help)
    p.add_argument("--span-tokens", type=int, default=DEFAULT_SPAN_TOKENS,
                   help="tokens each span decodes")
    p.add_argument("--span-warmup", type=int, default=SPAN_WARMUP_ITERATIONS,
                   help="iterations each span decodes before it is timed and counted")


def add_output_args(p: argparse.ArgumentParser, out: str, from_json_help: str) -> None:
    """--from-json (summarize rows measured earlier) and --out (default ``out``)."""
    p.add_argument("--from-json", type=Path, default=None, help=from_json_help)
    p.add_argument("--out", default=out, help="path without suffix: writes OUT.md and OUT.json")
