"""The benchmarks on the CPU: what a decode step must read, where results are written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from vegas_core import load_model


def test_a_decode_steps_floor_counts_routed_experts_and_sliding_windows(tiny_hf):
    from bench.steps import experts_read, kv_bytes_read, weight_bytes_read
    from vegas_core.model import MixtureOfExperts

    path, _ = tiny_hf("gpt_oss")  # 8 experts, top 2; layers 0 and 2 slide over 8 slots
    model = load_model(str(path), device="cpu", dtype="float32")
    net, config = model.net, model.config
    cache = net.new_cache(2, 64)
    cache.lengths.fill_(40)
    routed = experts_read(model, cache, torch.tensor([[5], [9]]), cache.lengths[:, None])
    moe_layers = [i for i, b in enumerate(net.layers) if isinstance(b.mlp, MixtureOfExperts)]
    assert sorted(routed) == moe_layers and all(2 <= n <= 4 for n in routed.values())

    every = weight_bytes_read(net)
    assert weight_bytes_read(net, {i: 8 for i in moe_layers}) == every
    embeddings = net.embed_tokens.weight.numel() * 4
    assert every == sum(p.numel() * 4 for p in net.parameters()) - embeddings
    per_expert = sum(t.numel() * 4 for t in (net.layers[0].mlp.experts_gate_up,
                                             net.layers[0].mlp.experts_down,
                                             net.layers[0].mlp.experts_gate_up_bias,
                                             net.layers[0].mlp.experts_down_bias)) // 8
    one_each = weight_bytes_read(net, {i: 1 for i in moe_layers})
    assert every - one_each == 7 * per_expert * len(moe_layers)

    per_token = 2 * config.num_kv_heads * config.head_dim * 4
    windows = [8 if config.window.applies(i) else 40 for i in range(config.num_layers)]
    assert windows == [8, 40, 8]
    assert kv_bytes_read(config, 40, 2, dtype_bytes=4) == per_token * 2 * sum(windows)


def test_an_output_name_with_dots_keeps_them():
    """``--out runs/e2e-budget-0.02`` writes e2e-budget-0.02.md, not e2e-budget-0.md."""
    from pathlib import Path

    from bench.acceptance import with_ext

    out = Path("runs/end-to-end-budget-0.02")
    assert with_ext(out, ".md") == Path("runs/end-to-end-budget-0.02.md")
    assert with_ext(out, ".json").name == "end-to-end-budget-0.02.json"


BENCH = Path(__file__).resolve().parents[1] / "bench"
# Where the benchmarks write unless told otherwise: a folder git ignores. The raw rows
# (per-prompt tokens, every sweep point) stay out of the repository; docs/results/ quotes
# the figures, each with the command that made them.
RUNS = "runs/"


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_write_to_the_ignored_runs_folder_by_default(script):
    text = script.read_text(encoding="utf-8")
    defaults = re.findall(r'"--out",[^)]*?default="([^"]+)"', text, re.DOTALL)
    assert all(d.startswith(RUNS) for d in defaults), defaults
    assert "--out docs/" not in text, "an example writes raw rows into docs/"


def test_the_runs_folder_is_ignored_and_made_on_write(tmp_path):
    from bench.acceptance import write_atomic

    ignored = (BENCH.parent / ".gitignore").read_text(encoding="utf-8").splitlines()
    assert RUNS in ignored
    out = tmp_path / "runs" / "deeper" / "table.md"
    write_atomic(out, "| a |\n")
    assert out.read_text() == "| a |\n"
    assert [p.name for p in out.parent.iterdir()] == ["table.md"]  # no temporary left


@pytest.mark.parametrize("args, message", [
    (["--scores"], "--scores needs --verify-rows"),
    (["--verify-rows", "7", "--draft-sparsity", "0.05"], "give one"),
    (["--verify-rows", "0"], "at least 1"),
])
def test_step_breakdown_refuses_options_that_name_no_single_step(args, message):
    """Checked before it looks for a GPU: a one-line usage error and exit status 2."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "step_breakdown.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr.strip().splitlines()[-1]


def test_vegas_is_compared_with_streaming_at_its_own_gamma_and_at_streamings_best():
    """With several gammas, a gamma that suits vegas must not hide a better streaming
    gamma: the report gives both ratios, per batch."""
    from bench.end_to_end import vegas_against_streaming

    def run(batch, method, gamma, rate, accepted=None):
        return dict(batch=batch, method=method, gamma=gamma, run=f"{method} g{gamma}",
                    steady_tokens_per_second=rate, mean_accepted_length=accepted,
                    selection_overhead=0.02)

    runs = [dict(batch=256, method="vanilla", gamma=None, run="vanilla",
                 steady_tokens_per_second=20_000.0),
            run(256, "vegas", 6, 55_000.0, 5.9), run(256, "streaming", 6, 50_000.0, 5.6),
            run(256, "vegas", 8, 60_000.0, 7.0), run(256, "streaming", 8, 52_000.0, 6.5),
            run(64, "vegas", 6, 30_000.0, 5.9), run(64, "streaming", 8, 40_000.0, 6.1)]
    rows = [line for line in vegas_against_streaming(runs) if line.startswith("| 256")]
    assert rows == ["| 256 | vegas g6 | 1.100x | 1.058x (streaming g8) | 5.90 / 5.60 | 2.0% |",
                    "| 256 | vegas g8 | 1.154x | 1.154x (streaming g8) | 7.00 / 6.50 | 2.0% |"]
    # No streaming run at vegas's gamma: only the best-gamma comparison.
    (row64,) = [line for line in vegas_against_streaming(runs) if line.startswith("| 64")]
    assert row64 == "| 64 | vegas g6 | - | 0.750x (streaming g8) | 5.90 / - | 2.0% |"
    assert vegas_against_streaming([r for r in runs if r["method"] != "streaming"]) == []


def test_end_to_end_json_reads_back_equal_with_one_line_per_key():
    """The results JSON is written compactly (token lists are most of a batch-256 run)
    and must still read back to the same data for ``--from-json``."""
    import json

    from bench.end_to_end import compact_json

    data = {"meta": {"args": {"ctx": 8000, "out": "runs/e2e|x"}, "seconds": 1.5},
            "runs": [{"batch": 256, "method": "vegas", "mean_accepted_length": None}],
            "tokens": [{"batch": 256, "tokens": [[1, 2, 3], [4, 5]]}]}
    text = compact_json(data)
    assert json.loads(text) == data
    lines = text.splitlines()  # "{", one line per key, "}"
    assert len(lines) == len(data) + 2 and lines[1].startswith('"meta": {')
    assert len(text) < len(json.dumps(data, indent=1))


def test_kernel_resources_are_read_from_cuobjdumps_report():
    from bench.kernel_resources import parse_resource_usage

    report = ("\nResource usage:\n Common:\n  GLOBAL:0\n Function _verify_split_kernel:\n"
              "  REG:175 STACK:8 SHARED:1024 LOCAL:0 CONSTANT[0]:728 TEXTURE:0 SURFACE:0\n")
    assert parse_resource_usage(report) == {"REG": 175, "STACK": 8, "SHARED": 1024, "LOCAL": 0}
    with pytest.raises(ValueError, match="STACK"):
        parse_resource_usage(report.replace("STACK:8 ", ""))


SPLIT_KERNEL_COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from bench.kernel_resources import H200_SMS, compile_split_kernel, load_module, resource_usage

driver, hook = triton.runtime.driver._active, triton.knobs.runtime.jit_cache_hook
kernel, constexprs, splits = compile_split_kernel(
    load_module(), (9, 3, 64), batch=256, rows=7, ctx=8192, fused=True,
    target=GPUTarget("cuda", 90, 32), sms=H200_SMS)
print(json.dumps({
    "splits": splits, "usage": resource_usage(kernel.asm["cubin"]),
    "constexprs": {k: constexprs[k] for k in ("COLLECT", "BLOCK_M", "BLOCK_N", "T", "G")},
    "restored": (triton.runtime.driver._active, triton.knobs.runtime.jit_cache_hook)
                == (driver, hook)}))
"""


def test_the_split_kernel_compiles_for_an_h200_on_a_machine_without_one(tmp_path):
    """The launch Triton would specialise on the GPU (a split count of 1, fused scores),
    compiled for sm_90 from an empty kernel cache; the driver and the pre-compile hook are
    given back afterwards. In a process of its own: where TRITON_INTERPRET was set when
    Triton was imported (as in these tests), Triton's own library functions (tl.zeros)
    stay interpreted and no kernel that calls them compiles."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", SPLIT_KERNEL_COMPILE], env=env,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["splits"] == 1 and result["restored"]
    assert result["constexprs"] == {"COLLECT": True, "BLOCK_M": 32, "BLOCK_N": 128, "T": 7,
                                    "G": 3}
    assert 0 < result["usage"]["REG"] <= 255 and result["usage"]["STACK"] >= 0


def test_the_gemv_bench_times_every_weight_of_a_layer_and_the_lm_head():
    """Its projections cover each dense layer's weights (q/k/v and gate/up packed) and
    the LM head, as the model holds them."""
    from bench.gemv import projections

    shapes = projections("qwen3-8b")
    assert shapes == {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
                      "gate_up + silu": (24576, 4096, True), "down": (4096, 12288, False),
                      "lm_head": (151936, 4096, False)}
    net = load_model("dummy:tiny", device="cpu").net
    layer = {name: tuple(p.shape) for name, p in net.layers[0].named_parameters()
             if p.dim() == 2}
    tiny = projections("tiny")
    assert layer == {"self_attn.qkv_proj.weight": tiny["qkv"][:2],
                     "self_attn.o_proj.weight": tiny["o"][:2],
                     "mlp.gate_up_proj.weight": tiny["gate_up + silu"][:2],
                     "mlp.down_proj.weight": tiny["down"][:2]}
    assert tuple(net.lm_head.weight.shape) == tiny["lm_head"][:2]


def test_a_recorded_tune_replays_through_todays_cost_model_and_race_rule():
    """The committed H100 tune (SmolLM2 8k, batch 64): today's extend rule from the
    recorded sweep beside what it extended, every raced configuration gets a prediction
    from the recorded sweep, and today's race rule, replayed on the recorded rounds,
    decides within them and picks what the recorded race picked."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    journal = root / "tests" / "data" / "tune-h100-smollm2-8k-b64.journal"
    out = subprocess.run([sys.executable, str(root / "bench" / "replay_tune.py"), str(journal)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| vegas") or
            line.startswith("| streaming")]
    assert len(rows) == 5 and all("n/a" not in row for row in rows)
    assert "race candidates" not in out  # only with --grid
    # This tune extended nothing: its best pairs lay inside the budget axis. Today's rule
    # also extends an edge predicted within 10% of a drafter's best.
    assert "Extend, recorded: nothing." in out
    today = out.split("Extend, today's rule from the recorded sweep: ")[1].split("\n")[0]
    assert "budget up to 2048 slots for streaming" in today
    assert "decided after round" in out
    recorded = out.split("Recorded race: ")[1].split("pick ")[1].split(" ")[0]
    today = out.split("Today's rule")[1].split("pick ")[1].split(" ")[0]
    assert recorded == today


def test_replay_with_a_grid_lists_todays_candidates_beside_their_grid_runs(tmp_path):
    """--grid: today's candidates from the recorded sweep, each with its one grid run,
    and how far the best of them lies below the grid's best."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from vegas_tune.space import selections

    root = Path(__file__).resolve().parents[1]
    journal = root / "tests" / "data" / "tune-h100-smollm2-8k-b64.journal"
    # A grid of the recorded tune's space (vllm target), vegas at 512 slots fastest.
    def speedup(s, b, g):
        return 2.0 + (s.drafter == "vegas") * 0.1 + (b == 512) * 0.05 - abs(g - 9) / 100

    rows = [{"drafter": s.drafter, "score": s.score if s.drafter == "vegas" else "logit",
             "window": s.window, "budget": b, "gamma": g, "speedup": speedup(s, b, g),
             "tokens_per_second": 100.0 * speedup(s, b, g)}  # vanilla at 100 tokens/s
            for s in selections("vllm") for b in (128, 256, 512, 1024) for g in range(1, 13)]
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"workload": {"batch_size": 64}, "grid": {"rows": rows}}))
    out = subprocess.run([sys.executable, str(root / "bench" / "replay_tune.py"), str(journal),
                          "--grid", str(grid)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    table = out.split("Today's race candidates")[1].split("Grid's best")[0]
    candidates = [line for line in table.splitlines() if line.startswith("| vegas")
                  or line.startswith("| streaming")]
    # The three best pairs and each drafter's two best (at most two more), each at up
    # to three gammas.
    assert 3 <= len(candidates) <= 5 * 3 and all(line.endswith("x |") for line in candidates)
    assert "Grid's best: vegas weight window 0.0, 512 slots, gamma 9: 2.150x" in out
    below = float(out.split("the best candidate's run is ")[1].split("%")[0])
    assert 0.0 <= below < 5.0
    # The cost model against every grid point it predicts, by rule and in all.
    errors = out.split("against the grid's points it predicts:")[1].split("\n\n")[1]
    rows = {line.split(" | ")[0][2:]: line for line in errors.splitlines()[2:]}
    assert set(rows) == {"streaming", "vegas weight", "all"}
    points = [int(rows[f].split(" | ")[1]) for f in ("streaming", "vegas weight", "all")]
    assert points[0] + points[1] == points[2] > 0


def _recall_means(spec):
    from bench.key_recall import RecallProbe
    from tests.test_engine import tiny_model
    from vegas_core import generate

    model = tiny_model()
    prompt = [3 + (i * 7) % 50 for i in range(60)]
    with RecallProbe().installed() as probe:
        generate(model, [prompt], 6, ignore_eos=True, spec=spec)
    return model, probe.means()


def test_key_recall_accounts_for_all_the_mass_and_sees_every_selecting_layer():
    from vegas_core import SpecConfig

    model, means = _recall_means(SpecConfig(gamma=3, sparsity=0.01, min_tokens=2))
    assert sorted(means) == list(range(model.config.num_layers))
    for m in means.values():
        # The tail is always read: what the draft reads and misses make the whole row.
        whole = m["captured"] + m["missed_sink"] + m["missed_recent"] + m["missed_far"]
        assert whole == pytest.approx(1.0, abs=1e-5)
        assert m["captured"] < 1.0 - 1e-3 and m["captured"] >= m["tail"]


def test_key_recall_of_a_budget_covering_the_prefix_is_whole():
    from vegas_core import SpecConfig

    _, means = _recall_means(SpecConfig(gamma=3, sparsity=1.0, min_tokens=2))
    assert all(m["captured"] == pytest.approx(1.0, abs=1e-5) for m in means.values())
    assert all(m["output_error"] < 1e-4 for m in means.values())


def test_bench_configurations_parse_and_refuse_unknown_options():
    from bench.spec_options import parse_config
    from vegas_core import VegasError

    assert parse_config("vegas:score=weight,accumulate=0.5") == (
        "vegas:score=weight,accumulate=0.5", "vegas", {"score": "weight", "accumulate": 0.5})
    assert parse_config("vegas:spread=4")[2] == {"spread": 4}
    with pytest.raises(VegasError, match="takes a number"):
        parse_config("vegas:spread=x")
    with pytest.raises(VegasError, match="name=value"):
        parse_config("vegas:decay=0.5")
    with pytest.raises(VegasError, match="accumulate"):
        parse_config("streaming:accumulate=0.5")


def test_profiles_decode_the_same_mixed_lengths_side_by_side(tmp_path):
    """bench/profile_compare.py: every method decodes the same prompts of lengths drawn
    in the range, in every round; the summary reads back from its JSON."""
    import json
    import subprocess
    import sys

    from bench.profile_compare import prompt_lengths
    from tests.test_profile import sample_profile_dict, several_contexts_dict
    from vegas_tune.profile import profile_from_dict, write_profile

    lengths = prompt_lengths(50, 32, 96, seed=1)
    assert lengths == prompt_lengths(50, 32, 96, seed=1) and min(lengths) >= 32
    assert max(lengths) <= 96 and len(set(lengths)) > 10
    write_profile(profile_from_dict(several_contexts_dict()), tmp_path / "two.yaml")
    write_profile(profile_from_dict(sample_profile_dict()), tmp_path / "one.yaml")
    out = tmp_path / "cmp"
    command = [sys.executable, str(BENCH / "profile_compare.py"), "--model", "dummy:tiny",
               "--device", "cpu", "--dtype", "float32", "--profiles", str(tmp_path / "two.yaml"),
               str(tmp_path / "one.yaml"), "--min-ctx", "32", "--max-ctx", "96",
               "--batch-size", "3", "--max-new-tokens", "6", "--rounds", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.with_name("cmp.json").read_text())
    assert [list(r) for r in data["rounds"]] == [["vanilla", str(tmp_path / "two.yaml"),
                                                  str(tmp_path / "one.yaml")]] * 2
    table = out.with_name("cmp.md").read_text()
    assert table.count("\n| ") == 5 and "over the first profile" in table  # head, rule, 3 rows
    again = subprocess.run([*command[:2], "--from-json", str(out.with_name("cmp.json")),
                            "--out", str(tmp_path / "again")], capture_output=True, text=True)
    assert again.returncode == 0 and (tmp_path / "again.md").read_text() == table
    refused = subprocess.run([*command[:2], "--profiles", str(tmp_path / "one.yaml"),
                              "--rounds", "1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--rounds must be at least 2" in refused.stderr


def test_a_band_of_a_profile_of_several_contexts_decodes_as_a_profile_of_one(tmp_path):
    """``P.yaml@CTX`` in bench/profile_compare.py: the entries P tuned at CTX, at every
    context."""
    import copy
    import dataclasses

    from bench.profile_compare import load_method
    from tests.test_profile import _in_two_bands, sample_profile_dict
    from vegas_core import VegasError
    from vegas_tune.profile import profile_from_dict, write_profile

    data = sample_profile_dict()
    short = copy.deepcopy(data["schedule"])
    for entry in short:  # at 4096 tokens: 64 slots where the 8192 band speculates
        if isinstance(entry["config"], dict):
            entry["config"]["min_tokens"] = 64
    path = tmp_path / "two.yaml"
    write_profile(profile_from_dict(_in_two_bands(data, short)), path)
    _, whole = load_method(str(path))
    _, band_4k = load_method(f"{path}@4096")
    _, band_8k = load_method(f"{path}@8192")
    assert whole.has_contexts and not band_4k.has_contexts
    sizes = sorted({e.batch_min for e in whole.entries})
    for size in sizes:
        assert band_4k.for_batch(size, 8192) == whole.for_batch(size, 4096)
        assert band_8k.for_batch(size, 100) == whole.for_batch(size, 8192)
    assert band_4k.for_batch(sizes[-1], 8192) == dataclasses.replace(
        band_8k.for_batch(sizes[-1]), min_tokens=64)  # the 4096 band, even at 8192
    with pytest.raises(VegasError, match="PATH@CONTEXT"):
        load_method(f"{path}@4k")
    write_profile(profile_from_dict(sample_profile_dict()), tmp_path / "one.yaml")
    with pytest.raises(VegasError, match="tuned at one context"):
        load_method(f"{tmp_path / 'one.yaml'}@4096")


def test_the_switch_bench_times_a_schedule_alternating_between_two_configurations(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "switch"
    done = subprocess.run(
        [sys.executable, str(BENCH / "schedule_switch.py"), "--model", "dummy:tiny",
         "--device", "cpu", "--dtype", "float32", "--batch", "2", "--ctx", "24",
         "--new-tokens", "16", "--every", "4", "--repeats", "1",
         "--configs", "vegas:gamma=3,min_tokens=4", "vanilla", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = json.loads(out.with_suffix(".json").read_text())
    switching = row["switching"]
    assert switching["switches"] >= 2 and switching["switch_seconds"] > 0
    assert set(switching["iterations_by_config"]) == set(row["alone"]) == {
        "vegas gamma 3 sparsity 0.05 min_tokens 4", "vanilla"}
    assert "Outputs equal token for token: yes" in done.stdout
    assert "ms per switch (direct)" in out.with_suffix(".md").read_text()


def test_the_switch_bench_reads_vanilla_and_every_speculative_field():
    from bench.schedule_switch import alternating, parse_switch_config
    from vegas_core import SpecConfig, VegasError

    assert parse_switch_config("vanilla") is None
    assert parse_switch_config("streaming:gamma=4,sparsity=0.1") == SpecConfig(
        drafter="streaming", gamma=4, sparsity=0.1)
    with pytest.raises(VegasError, match="SpecConfig field"):
        parse_switch_config("vegas:budget=4")
    schedule = alternating(None, SpecConfig(gamma=2), 10, 20, 4, 8)
    assert [schedule.for_batch(8, c) for c in (10, 11, 14, 15, 19, 30)] == [
        None, SpecConfig(gamma=2), SpecConfig(gamma=2), None, SpecConfig(gamma=2),
        SpecConfig(gamma=2)]


def test_the_graph_acceptance_bench_measures_each_mode_from_a_released_workspace(tmp_path):
    """On the CPU every mode runs the reference attention, so all three must accept alike;
    on a GPU this is the comparison of captured drafts with eager ones."""
    import json

    from bench.graph_acceptance import main

    out = tmp_path / "modes"
    main(["--model", "dummy:tiny", "--device", "cpu", "--dtype", "float32", "--ctx", "60",
          "--batch-sizes", "2", "--max-new-tokens", "12", "--configs",
          "vegas:gamma=3,min_tokens=8", "streaming:gamma=2,min_tokens=8", "--out", str(out)])
    rows = json.loads(out.with_name("modes.json").read_text())["rows"]
    assert [(r["mode"], r["config"]) for r in rows] == [
        (m, c) for m in ("graphs", "eager", "reference")
        for c in ("vegas:gamma=3,min_tokens=8", "streaming:gamma=2,min_tokens=8")]
    for config in {r["config"] for r in rows}:
        assert len({r["mean_accepted_length"] for r in rows if r["config"] == config}) == 1
    assert "| 2 | `streaming:gamma=2,min_tokens=8` | reference |" in out.with_name(
        "modes.md").read_text()


def test_the_graph_acceptance_bench_records_a_refused_measurement_and_goes_on(monkeypatch):
    from bench import graph_acceptance
    from vegas_core import load_model
    from vegas_core.errors import VegasError
    from vegas_tune.datasets import load_prompts
    from vegas_tune.measure import Measurer

    calls = []
    measure = Measurer.measure

    def first_fails(self, spec, report=None):
        calls.append(spec)
        if len(calls) == 1:
            raise VegasError("1 merge counter(s) of the attention kernels were left out of phase")
        if len(calls) == 2:
            raise MemoryError("no room for a private graph pool")
        if len(calls) == 3:
            raise RuntimeError("a fault that is not a refusal")
        return measure(self, spec, report)

    monkeypatch.setattr(Measurer, "measure", first_fails)
    model = load_model("dummy:tiny", device="cpu", dtype="float32")
    prompts = load_prompts(model.tokenizer, "mixed", 60, 2, 0)
    config = "vegas:gamma=3,min_tokens=8"
    configs = [(config, graph_acceptance.parse_switch_config(config))]
    rows = graph_acceptance.measure_modes(model, prompts, [2], configs,
                                          ["eager", "reference"], 12, 0)
    assert "out of phase" in rows[0]["error"] and "no room" in rows[1]["error"]
    with pytest.raises(RuntimeError, match="not a refusal"):  # anything else stops the run
        graph_acceptance.measure_modes(model, prompts, [2], configs, ["eager"], 12, 0)
    rows += graph_acceptance.measure_modes(model, prompts, [2], configs, ["reference"], 12, 0)
    assert rows[2]["mean_accepted_length"] > 1
    table = graph_acceptance.markdown(rows, {"hardware": "cpu", "date": "d", "command": "c"})
    assert "| 2 | `vegas:gamma=3,min_tokens=8` | eager | failed: 1 merge counter(s)" in table


def test_the_graph_acceptance_benchs_diagnostic_modes_patch_and_restore():
    """``graphs-merge-launch`` keeps every split kernel from merging in its last program,
    ``graphs-private-pools`` captures each graph into its own pool; both capture (on a
    GPU) and leave the engine as it was."""
    import os

    from bench.graph_acceptance import in_mode
    from vegas_core import graphs
    from vegas_kernels import launch

    assert launch.merges_in_kernel(2, 4, 256)
    shared = graphs.StepGraph
    with in_mode("graphs-merge-launch"):
        assert not launch.merges_in_kernel(2, 4, 256)
        assert os.environ["VEGAS_CUDA_GRAPHS"] == "auto"
    with in_mode("graphs-private-pools"):
        assert graphs.StepGraph(lambda: None, torch.device("cpu"), pool=object()).pool is None
    assert launch.merges_in_kernel(2, 4, 256) and graphs.StepGraph is shared


def test_the_poisoned_mode_fills_the_sparse_kernels_partials_which_are_all_written():
    """``graphs-poisoned`` hands the sparse kernel NaN partials; a launch writes every
    partial its merge reads, so its output stays the reference's."""
    pytest.importorskip("triton")
    from bench.graph_acceptance import in_mode
    from vegas_kernels import sparse_attention as sparse, split_merge

    g = torch.Generator().manual_seed(5)
    b, h, d, s = 3, 4, 64, 300
    q, k, v = (torch.randn(*shape, generator=g) for shape in
               ((b, 1, h, d), (b, 1, s, d), (b, 1, s, d)))
    positions = torch.tensor([[280], [250], [299]])
    indices = torch.stack([torch.randperm(200, generator=g)[:90] for _ in range(b)])[:, None]
    counts, tail = torch.tensor([90, 60, 30]), torch.tensor([270, 240, 290])
    want = sparse.reference_sparse_attention(q, k, v, positions, indices, counts, tail)
    with in_mode("graphs-poisoned"):
        assert sparse.split_buffers(1, 1, 2, 4, 8, "cpu")[0].isnan().all()
        got = sparse.sparse_attention(q, k, v, positions, indices, counts, tail, max_keys=200,
                                      splits=3, block_n=32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sparse.split_buffers is split_merge.split_buffers  # given back
