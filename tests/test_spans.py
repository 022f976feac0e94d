"""Long generations over sampled spans (vegas_tune.spans): where spans lie, the contexts
they start from, the warm-up that generate leaves out of its statistics, that a span's
greedy output is the whole generation's at those positions (float32, CPU), and the
measurer and tuner on a span workload."""

from __future__ import annotations

import pytest

from vegas_core import SpecConfig, generate
from vegas_core.errors import VegasError
from vegas_tune.datasets import Prompt, load_prompts
from vegas_tune.measure import Measurer, Workload
from vegas_tune.spans import (SpanLayout, prompts_for_rows, reference_continuations,
                              span_rows)
from tests.test_engine import prompt, tiny_model


def test_spans_are_centred_on_equal_strata_and_do_not_overlap():
    layout = SpanLayout(generation_tokens=6000, spans=4, span_tokens=256)
    starts = layout.starts()
    assert starts == [622, 2122, 3622, 5122]
    for j, start in enumerate(starts):
        assert start + layout.span_tokens / 2 == pytest.approx((j + 0.5) * 6000 / 4, abs=0.5)
    ends = [s + layout.max_new_tokens for s in starts]
    assert all(end <= nxt for end, nxt in zip(ends, starts[1:]))
    assert ends[-1] <= 6000 and layout.reference_tokens == starts[-1]
    # Spans as long as their strata tile the generation.
    tiled = SpanLayout(generation_tokens=400, spans=4, span_tokens=100)
    assert tiled.starts() == [0, 100, 200, 300]


@pytest.mark.parametrize("spans, span_tokens, fragment", [
    (0, 16, "--spans must be >= 1"),
    (2, 0, "--span-tokens must be >= 1"),
    (8, 126, "do not fit apart in --max-new-tokens 1000"),
])
def test_spans_that_do_not_fit_the_generation_are_refused_naming_the_options(
        spans, span_tokens, fragment):
    with pytest.raises(VegasError, match=fragment):
        SpanLayout(1000, spans, span_tokens)


def test_rows_hold_every_span_deepest_first_from_the_prompt_and_its_reference():
    layout = SpanLayout(generation_tokens=40, spans=2, span_tokens=4)
    prompts = [Prompt("a", [1, 2]), Prompt("b", [3])]
    continuations = [list(range(100, 140)), list(range(200, 240))]
    rows = span_rows(prompts, continuations, layout)
    shallow, deep = layout.starts()
    assert [r.name for r in rows] == [f"a@{deep}", f"a@{shallow}", f"b@{deep}", f"b@{shallow}"]
    assert rows[0].ids == [1, 2] + list(range(100, 100 + deep))
    assert rows[3].ids == [3] + list(range(200, 200 + shallow))
    assert prompts_for_rows(5, layout) == 3  # 3 prompts x 2 spans cover 5 rows
    with pytest.raises(VegasError, match="reference output has 3 tokens"):
        span_rows(prompts[:1], [[0, 1, 2]], layout)


def test_a_warm_up_is_decoded_but_neither_timed_nor_counted_for_acceptance():
    model = tiny_model()
    ids = [prompt(24, seed) for seed in range(2)]
    spec = SpecConfig(drafter="streaming", gamma=3, sparsity=0.2, min_tokens=8)
    whole = generate(model, ids, 30, spec=spec, ignore_eos=True)
    warmed = generate(model, ids, 30, spec=spec, ignore_eos=True, warmup_iterations=2)
    assert warmed.tokens == whole.tokens
    assert warmed.stats.iterations == whole.stats.iterations
    # Both sequences decode in every iteration: two rounds each left out.
    assert warmed.stats.sequence_rounds == whole.stats.sequence_rounds - 2 * 2
    assert warmed.stats.steady_iterations == whole.stats.steady_iterations - 2
    vanilla = generate(model, ids, 30, ignore_eos=True, warmup_iterations=5)
    # One token per step, 29 steps after the prefill's token: 5 left out.
    assert vanilla.stats.steady_iterations == 29 - 5
    assert vanilla.stats.steady_tokens == 2 * (29 - 5)
    with pytest.raises(VegasError, match="warmup_iterations must be >= 0"):
        generate(model, ids, 8, warmup_iterations=-1)


SPAN_SPECS = [
    SpecConfig(drafter="vegas", gamma=4, sparsity=0.1, min_tokens=16),
    SpecConfig(drafter="vegas", gamma=4, sparsity=0.1, min_tokens=16, score="weight",
               window=0.0, rule="fork"),
    SpecConfig(drafter="streaming", gamma=4, sparsity=0.1, min_tokens=16),
]


@pytest.mark.parametrize("spec", SPAN_SPECS, ids=lambda s: f"{s.drafter}-{s.rule}")
def test_a_spans_greedy_output_is_the_whole_generations_at_its_positions(spec):
    model = tiny_model()
    layout = SpanLayout(generation_tokens=120, spans=3, span_tokens=18)
    prompts = [Prompt(f"p{i}", prompt(20, i)) for i in range(2)]
    # The whole generation, vanilla: the reference a span's output must equal.
    whole = reference_continuations(model, [p.ids for p in prompts], 120, batch_size=2)
    rows = span_rows(prompts, whole, layout)
    out = generate(model, [r.ids for r in rows], layout.max_new_tokens, spec=spec,
                   ignore_eos=True, warmup_iterations=layout.warmup_iterations).tokens
    for row, tokens in zip(rows, out):
        name, start = row.name.split("@")
        assert tokens == whole[int(name[1:])][int(start):int(start) + layout.max_new_tokens]


def test_smollm2_spans_of_a_writing_prompt_match_vanilla_greedy(smollm):
    layout = SpanLayout(generation_tokens=96, spans=2, span_tokens=20)
    prompts = load_prompts(smollm.tokenizer, "writing", 96, 1)
    whole = reference_continuations(smollm, [p.ids for p in prompts], 96, batch_size=1)
    rows = span_rows(prompts, whole, layout)
    spec = SpecConfig(drafter="vegas", gamma=4, sparsity=0.1, min_tokens=32)
    out = generate(smollm, [r.ids for r in rows], layout.max_new_tokens, spec=spec,
                   ignore_eos=True, warmup_iterations=layout.warmup_iterations).tokens
    for row, tokens in zip(rows, out):
        start = int(row.name.rsplit("@", 1)[1])
        assert tokens == whole[0][start:start + layout.max_new_tokens]


def test_the_measurer_times_only_the_spans_after_their_warm_up():
    model = tiny_model()
    layout = SpanLayout(generation_tokens=160, spans=4, span_tokens=16)
    prompts = [Prompt(f"p{i}", prompt(24, i)) for i in range(2)]
    continuations = reference_continuations(model, [p.ids for p in prompts],
                                            layout.reference_tokens, batch_size=2)
    rows = span_rows(prompts, continuations, layout)
    workload = Workload(rows, 4, layout.max_new_tokens,
                        warmup_iterations=layout.warmup_iterations, positions=24 + 160)
    assert workload.longest_sequence == 184
    vanilla = Measurer(model, workload).measure(None)
    # Two batches of four rows; each decodes 15 steps after the prefill's token and
    # times those after the warm-up's 2.
    assert vanilla.steady_iterations == 2 * 13 and vanilla.steady_tokens == 2 * 13 * 4
    spec = SpecConfig(drafter="streaming", gamma=3, sparsity=0.1, min_tokens=16)
    measured = Measurer(model, workload).measure(spec)
    assert measured.tokens_per_second > 0 and 1.0 <= measured.mean_accepted_length <= 4.0
    assert measured.steady_iterations >= 2


# A long-generation tune small enough for seconds per trial on the CPU.
SPAN_TUNE = ["--model", "dummy:tiny", "--ctx", "64", "--dataset", "code", "--num-prompts",
             "2", "--max-new-tokens", "400", "--spans", "4", "--span-tokens", "20",
             "--probe-gamma", "4", "--budgets", "32,128", "--candidates", "1",
             "--max-rounds", "3", "--device", "cpu"]


def run_cli(argv, capsys):
    from vegas_tune import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_a_span_tune_records_its_spans_and_searches_budgets_above_the_prompt(tmp_path, capsys):
    import yaml

    out = tmp_path / "long.yaml"
    code, _, err = run_cli([*SPAN_TUNE, "--out", str(out)], capsys)
    assert code in (0, 3), err
    assert "4 spans of 20 tokens (timed after 2 iterations) at depths 40, 140, 240, 340" in err
    profile = yaml.safe_load(out.read_text())
    workload = profile["workload"]
    assert (workload["spans"], workload["span_tokens"],
            workload["span_warmup_iterations"]) == (4, 20, 2)
    assert workload["num_prompts"] == 1  # 2 rows: one prompt at four spans
    trials = out.with_suffix(".trials.csv").read_text().splitlines()
    column = trials[0].split(",").index("budget")
    budgets = {row.split(",")[column] for row in trials[1:] if row.startswith("sweep,")}
    # 128 slots lie above the 64-token prompt but below the deeper spans' contexts.
    assert {"32.0", "128.0"} <= budgets


@pytest.mark.parametrize("argv, fragment", [
    (["--spans", "8", "--span-tokens", "64"], "do not fit apart in --max-new-tokens 400"),
    (["--span-tokens", "19"], "--span-tokens 19 is too few to time a speculative iteration"),
    (["--spans", "-1"], "--spans must be >= 0"),
    (["--max-new-tokens", "16400"], "exceeds dummy:tiny's maximum of 16384 positions"),
    (["--budgets", "512"], "every budget covers the whole generation of --ctx + --max-new-tokens"),
])
def test_span_workloads_that_cannot_be_measured_are_refused_in_one_line(argv, fragment, tmp_path,
                                                                        capsys):
    code, _, err = run_cli([*SPAN_TUNE, "--out", str(tmp_path / "p.yaml"), *argv], capsys)
    assert code == 2 and "Traceback" not in err
    assert fragment in err and len(err.strip().splitlines()) == 1


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def run_bench(script: str, *argv: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *argv],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_the_acceptance_bench_decodes_spans_and_every_token_beside_them(tmp_path):
    import json

    out = tmp_path / "acc"
    proc = run_bench("acceptance.py", "--model", "dummy:tiny", "--device", "cpu",
                     "--datasets", "code", "--ctx", "64", "--max-new-tokens", "120",
                     "--spans", "2", "--span-tokens", "24", "--num-prompts", "1",
                     "--drafters", "vegas", "streaming", "--gamma", "3",
                     "--min-tokens", "32", "--full", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.with_name("acc.json").read_text())
    assert [r["drafter"] for r in rows] == ["vegas", "streaming"]
    assert all(r["matches_vanilla"] and r["full_mean_accepted_length"] >= 1.0 for r in rows)
    report = out.with_name("acc.md").read_text()
    assert "2 spans of 24 tokens (timed after 2 iterations) at depths 18, 78" in report
    assert "| vegas | " in report.split("Spans against every token")[1]


def test_the_end_to_end_bench_measures_rows_at_every_span_depth(tmp_path):
    import json

    out = tmp_path / "e2e"
    proc = run_bench("end_to_end.py", "--model", "dummy:tiny", "--device", "cpu",
                     "--dtype", "float32", "--dataset", "code", "--ctx", "64",
                     "--max-new-tokens", "200", "--spans", "2", "--span-tokens", "32",
                     "--batch", "2", "--gamma", "3", "--min-tokens", "32",
                     "--margins", "none", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.with_name("e2e.json").read_text())
    vanilla = next(r for r in data["runs"] if r["method"] == "vanilla")
    # Two rows of 32 tokens; one step per token after the prefill's, 2 left out.
    assert vanilla["steady_iterations"] == 31 - 2
    assert all(m["identical"] for m in data["matches"])
    assert "Long generations: every row is one of 2 spans of 32 tokens" in out.with_name(
        "e2e.md").read_text()


@pytest.mark.parametrize("script, argv, fragment", [
    ("acceptance.py", ["--max-new-tokens", "20000", "--spans", "2"],
     "exceeds dummy:tiny's 16384 positions"),
    ("acceptance.py", ["--max-new-tokens", "100", "--spans", "2"], "do not fit apart"),
    ("end_to_end.py", ["--max-new-tokens", "100", "--spans", "2"], "do not fit apart"),
])
def test_the_benches_refuse_spans_that_cannot_be_measured_in_one_line(script, argv, fragment):
    proc = run_bench(script, "--model", "dummy:tiny", "--device", "cpu", "--ctx", "64",
                     *argv)
    assert proc.returncode == 2 and fragment in proc.stderr
    assert "Traceback" not in proc.stderr
