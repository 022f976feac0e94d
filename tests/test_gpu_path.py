"""The fast path: Triton kernels on static buffers (CUDA graphs on a GPU).

On a GPU these tests capture and replay real CUDA graphs; without one they run the same
static-buffer steps eagerly (VEGAS_CUDA_GRAPHS=static) with the kernels in Triton's
interpreter. Either way the output must equal the PyTorch reference path token for token
(float32, greedy), for every option of the vegas drafter.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

pytest.importorskip("triton", reason="the fast path needs Triton")

from vegas_core import SpecConfig, generate  # noqa: E402
from vegas_core.scores import ScoreCollector  # noqa: E402
from vegas_core.sampling import SamplingParams  # noqa: E402
from vegas_core.speculative import SpeculativeSession  # noqa: E402
from tests.test_engine import tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Real capture on a GPU; the same static steps run eagerly elsewhere.
FAST = {"VEGAS_ATTENTION": "triton", "VEGAS_CUDA_GRAPHS": "auto" if DEVICE == "cuda" else "static"}
REFERENCE = {"VEGAS_ATTENTION": "reference", "VEGAS_CUDA_GRAPHS": "0"}
PROMPTS = [list(range(1, 70)), list(range(5, 40))]
NEW_TOKENS = 10


def use(monkeypatch, env: dict) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def finished_collectors(monkeypatch) -> list[ScoreCollector]:
    """Every collector whose scores a drafter is handed from now on, in order."""
    seen, finish = [], ScoreCollector.finish

    def spy(self, rows):
        seen.append(self)
        return finish(self, rows)

    monkeypatch.setattr(ScoreCollector, "finish", spy)
    return seen


@pytest.fixture(scope="module")
def model():
    m = tiny_model(head_dim=16)  # the kernels need a head dim of 16 or more
    m.net.to(DEVICE)
    return m


@pytest.fixture(scope="module")
def vanilla(model):
    with pytest.MonkeyPatch.context() as mp:
        use(mp, REFERENCE)
        return generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens


def test_static_vanilla_decode_matches_the_reference(model, vanilla, monkeypatch):
    use(monkeypatch, FAST)
    assert generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens == vanilla


VEGAS_OPTIONS = [
    dict(collect=c, score=s, granularity=g)
    for c, s, g in itertools.product(("two", "all", "last"), ("logit", "weight"),
                                     ("layer", "kv_head"))
] + [dict(window=0.5), dict(window=0.25, collect="last", score="weight"),
      # The vLLM fork's rule: a one-row window after the prefill, the verified window's
      # first slot among the candidates.
      dict(rule="fork", score="weight"), dict(rule="fork", collect="all", score="logit")]


@pytest.mark.parametrize("options", VEGAS_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_every_vegas_option_is_lossless_on_the_fast_path(model, vanilla, options, monkeypatch):
    use(monkeypatch, FAST)
    spec = SpecConfig(gamma=3, sparsity=0.1, min_tokens=4, **options)
    got = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, spec=spec)
    assert got.tokens == vanilla


@pytest.mark.parametrize("drafter, rule", [
    ("streaming", "engine"), ("streaming", "fork"), ("snapkv", "engine"),
    ("specextend", "engine"), ("quest", "engine"), ("dense", "engine")])
def test_peer_drafters_are_lossless_on_the_fast_path(model, vanilla, drafter, rule,
                                                     monkeypatch):
    use(monkeypatch, FAST)
    # 20 slots: the fork's streaming window is then one block besides the sink block.
    spec = SpecConfig(drafter=drafter, gamma=3, sparsity=0.1, min_tokens=20 if rule == "fork"
                      else 4, rule=rule)
    got = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, spec=spec)
    assert got.tokens == vanilla


@pytest.mark.parametrize("collect, score, granularity, rule", [
    ("last", "weight", "kv_head", "engine"), ("two", "weight", "layer", "engine"),
    ("last", "logit", "layer", "engine"), ("two", "weight", "layer", "fork")])
def test_kernel_scores_select_what_the_reference_selects(model, collect, score, granularity,
                                                         rule, monkeypatch):
    """The last row's scores are summed by the score kernel after acceptance, the first
    and last rows' probabilities from the logits the verify pass kept; the selection
    equals the reference path's, which keeps per-row tensors."""
    spec = SpecConfig(gamma=3, sparsity=0.1, min_tokens=4, collect=collect, score=score,
                      granularity=granularity, rule=rule)
    sessions, collectors = {}, finished_collectors(monkeypatch)
    for name, env in (("reference", REFERENCE), ("fast", FAST)):
        use(monkeypatch, env)
        session = SpeculativeSession(model, PROMPTS, spec, SamplingParams(), 8, prefill_chunk=32)
        session.step([True, True])
        sessions[name] = session
    fast = collectors[-1]  # the fast session's verify
    layers = model.config.num_layers
    assert len(fast._summed) == layers
    assert len(fast._deferred) == (0 if collect == "two" else layers)  # edges: no K pass
    assert not fast._per_row  # no per-row tensor was kept
    ref, got = sessions["reference"].selection, sessions["fast"].selection
    assert torch.equal(ref.counts, got.counts)
    for layer, b in itertools.product(range(layers), range(2)):
        for g in range(ref.indices.shape[2]):
            n = int(ref.counts[layer, b])
            assert (set(ref.indices[layer, b, g, :n].tolist())
                    == set(got.indices[layer, b, g, :n].tolist()))


def test_a_session_on_prompts_the_kept_cache_holds_computes_only_its_window(model,
                                                                            monkeypatch):
    """How benchmarks time long contexts without a prefill: K/V put into the model's
    kept cache by other means and its rows' prompts recorded. A session on those prompts
    computes only its first verify window and decodes as one that prefilled them."""
    from vegas_core.cache import PromptSlots
    from vegas_core.graphs import release_workspace, workspace
    from vegas_core.prefill import prefill

    use(monkeypatch, FAST)
    spec = SpecConfig(gamma=3, sparsity=0.1, min_tokens=4)
    ids = [PROMPTS[0][:50], PROMPTS[0][10:60]]
    release_workspace(model.net)
    usual = SpeculativeSession(model, ids, spec, SamplingParams(), 12, prefill_chunk=32)
    want = [usual.first_tokens()] + [usual.step([True, True]) for _ in range(3)]
    capacity = usual.cache.max_len
    release_workspace(model.net)
    filled = model.net.new_cache(2, capacity)  # "other means": a prefill elsewhere
    prefill(model, ids, filled, need_last_hidden=False)
    cache = workspace(model.net, 2, capacity, torch.device(DEVICE)).cache
    cache.k.copy_(filled.k)
    cache.v.copy_(filled.v)
    cache.prompts = [PromptSlots(p) for p in ids]
    computed = []
    resumed = SpeculativeSession(model, ids, spec, SamplingParams(), 12, prefill_chunk=32,
                                 progress=lambda phase, done, total: computed.append(total))
    assert not computed  # no prefill: the window is the session's first verify pass
    assert [resumed.first_tokens()] + [resumed.step([True, True]) for _ in range(3)] == want
    release_workspace(model.net)


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a GPU matter")
def test_an_iteration_synchronises_with_the_host_once(model, monkeypatch):
    use(monkeypatch, FAST)
    session = SpeculativeSession(model, PROMPTS, SpecConfig(gamma=3, sparsity=0.1, min_tokens=4),
                                 SamplingParams(), 40, prefill_chunk=32)
    for _ in range(2):  # compile and capture
        session.step([True, True])
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session.step([True, True])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]  # the tokens' copy to the host


def test_collectors_report_what_they_can_do():
    rows = torch.ones(1, 3)
    assert ScoreCollector("logit", None, rows).fusable
    assert not ScoreCollector("weight", None, rows).fusable
    assert ScoreCollector("weight", None, rows).keeps_edges
    assert not ScoreCollector("logit", None, rows).keeps_edges
    assert not ScoreCollector("weight", deferrable=True).summed_in_pass
    assert ScoreCollector("weight", deferrable=True).deferrable
    # A hybrid model's vegas collector keeps its global layers only, on either path.
    subset = ScoreCollector("weight", {1, 3}, deferrable=True, scores_out=torch.zeros(2, 1))
    assert subset.deferrable and subset.collects(3) and not subset.collects(2)
    assert subset.home(3).data_ptr() == subset.scores_out[1].data_ptr()
    with pytest.raises(ValueError, match="score mode"):
        ScoreCollector("logits")


def test_a_workspace_is_kept_across_calls_and_replaced_by_a_new_shape(model, monkeypatch):
    from vegas_core.graphs import release_workspace, workspace

    use(monkeypatch, FAST)
    dev = torch.device(DEVICE)
    first = workspace(model.net, 2, 300, dev)
    assert first.cache.max_len % 256 == 0 and first.cache.max_len >= 300
    assert workspace(model.net, 2, 200, dev) is first  # fits: reused, graphs and all
    bigger = workspace(model.net, 2, first.cache.max_len + 1, dev)
    assert bigger is not first and workspace(model.net, 1, 10, dev) is not bigger
    release_workspace(model.net)
    monkeypatch.setenv("VEGAS_CUDA_GRAPHS", "0")
    assert workspace(model.net, 2, 300, dev) is None  # eager steps allocate per call


def test_a_workspace_cache_keeps_its_prompts_for_later_calls(model, monkeypatch):
    """Prompt K/V once per tune: a later call on the same prompts computes only the slots
    that a speculative window rewrote, and its tokens equal the reference path's."""
    from vegas_core.graphs import release_workspace

    spec = SpecConfig(gamma=3, sparsity=0.1, min_tokens=8)
    calls = [None, spec, None]
    use(monkeypatch, REFERENCE)
    want = [generate(model, PROMPTS, NEW_TOKENS, spec=s, ignore_eos=True).tokens for s in calls]
    use(monkeypatch, FAST)
    release_workspace(model.net)
    computed = []
    for s, tokens in zip(calls, want):
        seen = [0]

        def progress(phase, done, total):
            if phase == "prefill":
                seen[0] = total

        assert generate(model, PROMPTS, NEW_TOKENS, spec=s, ignore_eos=True,
                        progress=progress).tokens == tokens
        computed.append(seen[0])
    window = spec.gamma + 1  # the speculative session's first verify window
    assert computed == [sum(map(len, PROMPTS)), 0, window * len(PROMPTS)]


def test_a_followed_schedule_reuses_each_configurations_static_steps(model, vanilla,
                                                                      monkeypatch):
    """Switching decoders on one cache: greedy output equals the reference, and a
    configuration met again makes no static step (on a GPU: captures no graph) beyond
    those it made the first time."""
    from vegas_core import SpecSchedule, graphs

    use(monkeypatch, FAST)
    made, init = [], graphs.StepGraph.__init__

    def spy(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(graphs.StepGraph, "__init__", spy)
    spec = SpecConfig(gamma=3, sparsity=0.1, min_tokens=4)

    def follow(*bands):
        """-> (output, step graphs made, captures) from a cache of its own."""
        graphs.release_workspace(model.net)
        made.clear()
        captures = graphs.capture_count()
        out = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                       spec=SpecSchedule([(1, 2, config, low, high)
                                          for config, low, high in bands]))
        return out, len(made), graphs.capture_count() - captures

    # The mean context starts at 52 (53 with the prefill's token) and ends at 62.
    there_and_back, made_back, captured_back = follow((spec, 1, 54), (None, 55, 58),
                                                      (spec, 59, 1000))
    there, made_there, captured_there = follow((spec, 1, 54), (None, 55, 1000))
    assert there_and_back.tokens == there.tokens == vanilla
    assert (there_and_back.stats.switches, there.stats.switches) == (2, 1)
    assert made_back == made_there > 0 and captured_back == captured_there


@pytest.mark.skipif(DEVICE != "cuda", reason="a batch of 128 at a real model's shape is "
                    "beyond Triton's interpreter on the CPU")
def test_steps_replayed_from_graphs_at_a_full_batch_decode_as_eager_ones(monkeypatch):
    """Gemma3-270M's shape (random weights, float32) at a batch of 128, where the decode
    and draft steps' launches merge in their last programs (test_kernels'
    test_a_full_batch_draft_step_replayed_many_times_matches_the_reference). Captured in
    CUDA graphs, vanilla decoding must give the eager kernels' tokens, and drafts must
    accept as many tokens at each position. (Captured drafts were once suspected at this
    batch on an H100; the difference measured then was in the processes' prompts,
    docs/results/tuner-regret.md.)"""
    from vegas_core.graphs import release_workspace
    from vegas_core.loading import load_model

    model = load_model("dummy:gemma3-270m", device=DEVICE, dtype="float32")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 4000, (1200 + 3 * i,), generator=g).tolist()
               for i in range(128)]
    specs = [None, SpecConfig(drafter="streaming", gamma=4, sparsity=0.01, min_tokens=256),
             SpecConfig(drafter="vegas", gamma=4, sparsity=0.01, min_tokens=128)]
    runs = {}
    for mode in ("auto", "0"):
        use(monkeypatch, {"VEGAS_ATTENTION": "triton", "VEGAS_CUDA_GRAPHS": mode})
        release_workspace(model.net)
        runs[mode] = [generate(model, prompts, 24, spec=spec, ignore_eos=True)
                      for spec in specs]
    release_workspace(model.net)
    assert runs["auto"][0].tokens == runs["0"][0].tokens
    # The draft's split counts differ (a graph's static key bound against the eager
    # step's), so its sums run in another order: allow a rare flipped choice, not a loss.
    for captured_run, eager_run in zip(runs["auto"][1:], runs["0"][1:]):
        assert captured_run.stats.acceptance_by_position == pytest.approx(
            eager_run.stats.acceptance_by_position, abs=0.02)


# The poked counter makes launches merge stale partials: overflows in the interpreter.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_call_that_leaves_merge_counters_out_of_phase_fails_and_resets_them(model,
                                                                              monkeypatch):
    """The kernels' last-program merges leave their counters at 0; one left above 0 means
    a launch merged incomplete partials. ``generate`` says so rather than return what
    such launches computed, and resets the counters so the next call starts clean."""
    from vegas_core.errors import VegasError
    from vegas_kernels import split_merge

    use(monkeypatch, FAST)
    generate(model, PROMPTS, max_new_tokens=2, ignore_eos=True)  # makes the counters
    counters = split_merge._counters[split_merge.counters_device(DEVICE)]
    assert counters.eq(0).all()
    with torch.inference_mode():
        counters[1] = 1  # as if a launch had merged before its last split arrived
    with pytest.raises(VegasError, match="out of phase"):
        generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert counters.eq(0).all()
    assert generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens
