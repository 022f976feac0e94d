"""`vegas-tune export --per-batch-size` of a profile tuned at several contexts (issue 44):
the batch form takes the longest context's band; `--context-ranges` writes every band in
the context form of vLLM's RFC 48627, which follows that form's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.test_profile import (MAX_MODEL_LEN, MID_TUNED, TUNED, sample_profile_dict,
                                uneven_contexts_dict)
from tests.test_validate import run, write
from vegas_core.errors import VegasError
from vegas_tune.export import render_export
from vegas_tune.profile import profile_from_dict
from vegas_tune.serving import (VLLM_BATCH_TABLE_KEY, check_vllm_batch_table,
                                check_vllm_context_table)

# uneven_contexts_dict's bands: contexts up to the geometric mean of 4096 and 8192, then
# the rest, which the export extends to the served max-model-len.
SHORT_BAND = (1, 5792)
LONG_BAND = (5793, MAX_MODEL_LEN)


def speculative_config(text: str, fmt: str = "yaml") -> dict:
    return yaml.safe_load(text)["speculative-config"] if fmt == "yaml" else json.loads(text)


def test_context_form_lists_every_band_and_follows_its_rules():
    profile = profile_from_dict(uneven_contexts_dict())
    text = render_export(profile, "vllm", "yaml", per_batch_size=True, context_ranges=True)
    speculative = speculative_config(text)
    table = speculative[VLLM_BATCH_TABLE_KEY]
    # Batch 64 was not tuned at 4096: that band's last range (2-8) covers larger sizes.
    assert table == [[1, 1, *SHORT_BAND, 0], [2, 8, *SHORT_BAND, MID_TUNED["gamma"]],
                     [1, 1, *LONG_BAND, 0], [2, 8, *LONG_BAND, MID_TUNED["gamma"]],
                     [9, 64, *LONG_BAND, TUNED["gamma"]]]
    check_vllm_context_table(table)
    assert speculative["num_speculative_tokens"] == TUNED["gamma"]
    # The served config is the headline's; the ranges measured with another budget say so.
    assert speculative["sparse_attn_ratio"] == TUNED["sparsity_ratio"]
    assert "ctx 1-5792, batch 2-8: measured with sparsity_ratio 0.1" in text
    assert "RFC 48627" in text and "which no vLLM release reads yet" in text
    as_json = render_export(profile, "vllm", "json", per_batch_size=True, context_ranges=True)
    assert speculative_config(as_json, "json") == speculative


def test_context_form_leaves_out_the_sizes_the_server_never_reaches():
    profile = profile_from_dict(uneven_contexts_dict())
    table = speculative_config(render_export(profile, "vllm", "yaml", serve_batch=8,
                                             per_batch_size=True, context_ranges=True)
                               )[VLLM_BATCH_TABLE_KEY]
    assert [row[:2] for row in table] == [[1, 1], [2, 8], [1, 1], [2, 8]]
    check_vllm_context_table(table)


def test_batch_form_of_several_contexts_is_the_longest_contexts_band():
    profile = profile_from_dict(uneven_contexts_dict())
    text = render_export(profile, "vllm", "yaml", per_batch_size=True)
    table = speculative_config(text)[VLLM_BATCH_TABLE_KEY]
    assert table == [[1, 1, 0], [2, 8, MID_TUNED["gamma"]], [9, 64, TUNED["gamma"]]]
    check_vllm_batch_table(table)
    assert "this table is the 8192 band's; --context-ranges gives every band" in text


@pytest.mark.parametrize("data, flags, fragment", [
    (sample_profile_dict, ["--per-batch-size", "--context-ranges"],
     "tuned at one context (8192 tokens), so it has no context ranges; drop --context-ranges"),
    (uneven_contexts_dict, ["--context-ranges"], "pass --per-batch-size too"),
])
def test_context_ranges_are_refused_in_one_line_leaving_nothing(tmp_path, capsys, data,
                                                                flags, fragment):
    path = write(tmp_path, data())
    out = tmp_path / "serve.yaml"
    code, stdout, err = run(["export", str(path), "--force", "--target", "vllm",
                             "--out", str(out), *flags], capsys)
    assert code == 2 and stdout == "" and err.count("\n") == 1 and fragment in err, err
    assert not out.exists()


def test_render_export_refuses_context_ranges_without_the_table():
    profile = profile_from_dict(uneven_contexts_dict())
    with pytest.raises(VegasError, match="pass --per-batch-size too"):
        render_export(profile, "vllm", "yaml", context_ranges=True)


def test_context_table_rules_accept_bands_with_their_own_ranges():
    check_vllm_context_table([[1, 8, 1, 100, 3], [9, 16, 1, 100, 0], [1, 16, 101, 200, 2]])


@pytest.mark.parametrize("table, problem", [
    ([], "non-empty list"),
    ([[1, 8, 1, 100, 2.0]], "five integers"),
    ([[1, 8, 1, 100, True]], "five integers"),
    ([[1, 8, 3]], "five integers"),  # the batch form is not the context form
    ([[1, 8, 1, 100, -1]], "K must be >= 0"),
    ([[1, 8, 100, 1, 3]], "0 < ctx_start <= ctx_end"),
    ([[1, 8, 2, 100, 3]], "expected ctx_start 1"),  # bands start at context 1
    ([[1, 8, 1, 100, 3], [1, 8, 50, 200, 3]], "expected ctx_start 101"),  # overlap
    ([[1, 8, 1, 100, 3], [1, 8, 102, 200, 3]], "expected ctx_start 101"),  # gap
    ([[1, 8, 1, 100, 3], [1, 8, 101, 200, 3], [9, 16, 1, 100, 2]], "sorted"),
    ([[2, 8, 1, 100, 3]], "context band 1-100: the first range must start at batch size 1"),
    ([[1, 8, 1, 100, 3], [8, 16, 1, 100, 2]], "context band 1-100: .* must not overlap"),
    ([[1, 0, 1, 100, 3]], "0 < start <= end"),
])
def test_context_table_rules(table, problem):
    with pytest.raises(ValueError, match=problem):
        check_vllm_context_table(table)


DOC = Path(__file__).resolve().parents[1] / "docs" / "profile-format.md"


def test_the_docs_examples_are_what_show_and_export_print(tmp_path, capsys):
    """docs/profile-format.md shows the table and the context form of this profile."""
    doc = DOC.read_text()
    code, stdout, _ = run(["show", str(write(tmp_path, uneven_contexts_dict()))], capsys)
    schedule = stdout[stdout.index("  schedule by batch size"):stdout.index("  recommended:")]
    assert code == 0 and schedule in doc, schedule
    profile = profile_from_dict(uneven_contexts_dict())
    table = speculative_config(render_export(profile, "vllm", "yaml", per_batch_size=True,
                                             context_ranges=True))[VLLM_BATCH_TABLE_KEY]
    documented = [line.split("#")[0].strip() for line in doc.splitlines()
                  if line.strip().startswith("- [") and line.count(",") == len(table[0]) - 1]
    assert documented == [f"- {row}" for row in table]
