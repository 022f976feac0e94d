"""Model specs: dummy presets, embedded lookup, HF config parsing."""

from __future__ import annotations

import pytest
import torch

from vegas_core import load_model
from vegas_core.config import PRESETS, ModelConfig, preset_config
from vegas_core.errors import VegasError
from vegas_core.model import Transformer

# Published parameter counts (model cards), to the precision the cards give.
PUBLISHED_PARAMS = {"qwen3-8b": 8.19e9, "qwen3-4b": 4.02e9, "llama-3.1-8b": 8.03e9,
                    "qwen2.5-7b": 7.62e9, "smollm2-135m": 0.135e9, "qwen3-30b-a3b": 30.5e9,
                    "gpt-oss-20b": 20.9e9, "gemma3-270m": 0.268e9}


@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"tiny"}))
def test_dummy_presets_have_the_published_size(preset):
    config = preset_config(preset)
    with torch.device("meta"):
        net = Transformer(config)
    counted = sum(p.numel() for p in net.parameters())  # tied weights counted once
    assert counted == config.num_parameters()
    assert counted == pytest.approx(PUBLISHED_PARAMS[preset], rel=0.01)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_dummy_presets_of_embedded_models_match_their_files(model):
    """Timing the dummy preset at real sizes stands for the embedded model only while the two
    shapes agree field for field."""
    import dataclasses

    from vegas_core.loading.embedded import embedded_path
    from vegas_core.loading.gguf import GGUFFile, gguf_config

    from_file = dataclasses.asdict(gguf_config(GGUFFile(embedded_path(model))))
    preset = dataclasses.asdict(preset_config(model))
    assert from_file.pop("rms_norm_eps") == pytest.approx(preset.pop("rms_norm_eps"))  # float32
    from_file.pop("name"), preset.pop("name")
    assert from_file == preset


def test_dummy_model_is_marked_and_runs():
    model = load_model("dummy:smollm2-135m", device="cpu", dtype="float32")
    assert model.is_dummy and "DUMMY" in model.label
    assert model.config.name == "dummy:smollm2-135m"


def test_transformers5_and_legacy_rope_fields_parse_the_same():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    legacy = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": scaling}, "a")
    modern = ModelConfig.from_hf({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}}, "a")
    assert legacy.rope_theta == modern.rope_theta == 5e5
    assert legacy.rope_scaling == modern.rope_scaling


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(VegasError, match="longrope"):
        ModelConfig.from_hf(dict(model_type="qwen3", vocab_size=10, hidden_size=8,
                                 intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2,
                                 rope_scaling=dict(rope_type="longrope", factor=4.0)), "q")
    with pytest.raises(VegasError, match="YaRN needs original_max_position_embeddings"):
        ModelConfig.from_hf(dict(model_type="qwen3", vocab_size=10, hidden_size=8,
                                 intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2,
                                 rope_scaling=dict(rope_type="yarn", factor=4.0)), "q")


def test_hub_id_resolves_from_the_local_cache_offline(tiny_hf, tmp_path, monkeypatch):
    import shutil

    from tests.test_hf_parity import full_logits

    path, _ = tiny_hf("qwen3")
    # The hub cache layout: models--owner--name/{refs/main, snapshots/<commit>/files}.
    repo = tmp_path / "hub" / "models--acme--tiny-qwen3"
    commit = "0" * 40
    shutil.copytree(path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    from_hub = load_model("acme/tiny-qwen3", device="cpu", dtype="float32")
    from_dir = load_model(str(path), device="cpu", dtype="float32")
    ids = list(range(3, 40))
    torch.testing.assert_close(full_logits(from_hub, ids), full_logits(from_dir, ids))


def test_unknown_hub_id_offline_is_a_user_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(VegasError, match="neither a local path nor"):
        load_model("acme/does-not-exist", device="cpu")


def test_the_gguf_header_reads_what_ggufs_own_reader_reads(smollm_path):
    """Our one-pass header parser against gguf.GGUFReader on the embedded SmolLM2 file:
    every metadata value, and every tensor's name, type, shape and bytes."""
    import gguf
    import numpy as np

    from vegas_core.loading.gguf_header import GGUFHeader

    ours, theirs = GGUFHeader(smollm_path), gguf.GGUFReader(str(smollm_path))
    assert ours.fields.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, value in ours.fields.items():
        assert value == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type and mine.dims == tuple(ref.shape.tolist())
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data), mine.name


@pytest.mark.parametrize("cut", [10, 24 + 8, 2_000_000, -1])
def test_a_gguf_cut_anywhere_is_reported_as_truncated(smollm_path, tmp_path, cut):
    from vegas_core.errors import VegasError
    from vegas_core.loading.gguf import GGUFFile

    data = smollm_path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])  # in the header, the vocabulary, the last tensor
    with pytest.raises(VegasError, match="truncated or corrupt"):
        GGUFFile(path)
