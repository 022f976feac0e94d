"""The tokenizer of a SentencePiece GGUF vocabulary, converted by transformers, is checked
against the vocabulary: transformers 5.17.0 converted Gemma3-270M's with no BOS and words
cut into short pieces, and its saved copy reloaded as one token per character."""

from __future__ import annotations

from pathlib import Path

import pytest

import transformers
from vegas_core.errors import VegasError
from vegas_core.loading import gguf

SPACE = "\u2581"
VOCAB = ["<pad>", "<eos>", "<bos>", "S", "o", SPACE + "the", SPACE + "of", SPACE + "and",
         SPACE + "time", SPACE, "t", "h", "e", "f", "a", "n", "d", "i", "m"]
INDEX = {t: i for i, t in enumerate(VOCAB)}


class FakeFile:
    def __init__(self, path, add_bos=True):
        self.path = path
        self.meta = {"tokenizer.ggml.tokens": VOCAB, "tokenizer.ggml.bos_token_id": 2,
                     "tokenizer.ggml.add_bos_token": add_bos}

    def get(self, key, default=None):
        return self.meta.get(key, default)

    def require(self, key):
        return self.meta[key]


class FakeTokenizer:
    """Whole words as their pieces (``whole``) or one token per character; BOS or not."""
    eos_token_id = 1

    def __init__(self, whole=True, bos=True):
        self.whole, self.bos = whole, bos

    def __call__(self, text):
        ids = [2] if self.bos else []
        first, *words = text.split(" ")
        ids += [INDEX[c] for c in first]
        for w in words:
            ids += [INDEX[SPACE + w]] if self.whole else [INDEX[SPACE]] + [INDEX[c] for c in w]
        return {"input_ids": ids}

    def save_pretrained(self, folder):
        (Path(folder) / "tokenizer.json").write_text("{}")


def test_a_tokenizer_that_follows_the_vocabulary_passes(tmp_path):
    assert gguf.tokenizer_problem(FakeTokenizer(), FakeFile(tmp_path)) is None


@pytest.mark.parametrize("tok, says", [(FakeTokenizer(whole=False), "not to the vocabulary's pieces"),
                                       (FakeTokenizer(bos=False), "asks for BOS 2")])
def test_a_tokenizer_that_cuts_words_or_drops_the_bos_is_named(tmp_path, tok, says):
    assert says in gguf.tokenizer_problem(tok, FakeFile(tmp_path))


def test_no_bos_is_expected_where_the_file_asks_for_none(tmp_path):
    assert gguf.tokenizer_problem(FakeTokenizer(bos=False), FakeFile(tmp_path, add_bos=False)) is None


def converting(monkeypatch, tmp_path, fresh, reloaded):
    """transformers' AutoTokenizer giving ``fresh`` for the GGUF and ``reloaded`` for a
    saved copy; the cache folder under tmp_path."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"gguf")
    monkeypatch.setenv("VEGAS_CACHE", str(tmp_path / "cache"))

    def from_pretrained(where, gguf_file=None):
        return fresh if gguf_file else reloaded

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return FakeFile(model)


def test_a_wrong_conversion_is_refused_naming_the_transformers_to_install(monkeypatch, tmp_path):
    gf = converting(monkeypatch, tmp_path, FakeTokenizer(whole=False), FakeTokenizer())
    with pytest.raises(VegasError, match=rf"transformers {transformers.__version__} converts "
                       rf".*install transformers>={gguf.GOOD_TRANSFORMERS}"):
        gguf._converted_tokenizer(gf)


def test_a_copy_that_reloads_differently_is_not_kept(monkeypatch, tmp_path):
    fresh = FakeTokenizer()
    gf = converting(monkeypatch, tmp_path, fresh, FakeTokenizer(whole=False))
    assert gguf._converted_tokenizer(gf) is fresh
    assert not list((tmp_path / "cache" / "tokenizers").iterdir())


def test_a_good_copy_is_kept_and_loaded_next_time(monkeypatch, tmp_path):
    fresh, copy = FakeTokenizer(), FakeTokenizer()
    gf = converting(monkeypatch, tmp_path, fresh, copy)
    assert gguf._converted_tokenizer(gf) is fresh
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    assert gguf._converted_tokenizer(gf) is copy


def test_a_kept_copy_that_no_longer_passes_is_converted_again(monkeypatch, tmp_path):
    """A copy an earlier release saved (one token per character) is not used."""
    fresh = FakeTokenizer()
    gf = converting(monkeypatch, tmp_path, fresh, FakeTokenizer())
    gguf._converted_tokenizer(gf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda where, gguf_file=None: fresh if gguf_file else FakeTokenizer(whole=False))
    assert gguf._converted_tokenizer(gf) is fresh
