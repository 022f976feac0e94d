"""Workload prompts: embedded datasets, local files, Hub ids and the dataset fingerprint."""

from __future__ import annotations

import json
import sys
import types

import pandas as pd
import pytest

from vegas_core.errors import VegasError
from vegas_tune.datasets import (EMBEDDED_DATASETS, Prompt, dataset_fingerprint,
                                 embedded_prompts, load_prompts)

CTX = 32


class WordTokenizer:
    """One id per whitespace-separated word: fast, and token counts are easy to predict."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(word, len(self.vocab)) for word in text.split()]


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def write_table(path, column: str, texts: list[str]):
    table = pd.DataFrame({"id": range(len(texts)), column: texts})
    if path.suffix == ".csv":
        table.to_csv(path, index=False)
    elif path.suffix == ".parquet":
        table.to_parquet(path, index=False)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in table.to_dict("records")))
    return path


@pytest.mark.parametrize("dataset", EMBEDDED_DATASETS)
def test_embedded_prompts_have_exactly_ctx_tokens(dataset):
    ctx = 512  # retrieval needs room for its key/value table and the repeated lines
    prompts = load_prompts(WordTokenizer(), dataset, ctx, count=3)
    assert len(prompts) == 3
    assert all(len(p.ids) == ctx for p in prompts)
    assert len({tuple(p.ids) for p in prompts}) == 3  # three different prompts
    # load_prompts is embedded_prompts for the embedded names.
    embedded = embedded_prompts(WordTokenizer(), dataset, ctx, 3)
    assert [p.ids for p in prompts] == [p.ids for p in embedded]


@pytest.mark.parametrize("dataset", EMBEDDED_DATASETS)
def test_embedded_prompts_stay_distinct_past_their_sources(dataset):
    # 16 code modules and 8 prose starting topics: 80 prompts take five rounds of each in
    # mixed. A batch filled with copies would decode copies, and its acceptance would be
    # that of fewer prompts than it claims.
    count = 80
    prompts = embedded_prompts(WordTokenizer(), dataset, 256, count)
    assert all(len(p.ids) == 256 for p in prompts)
    assert len({tuple(p.ids) for p in prompts}) == count
    assert len({p.name for p in prompts}) == count


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
@pytest.mark.parametrize("column", ["text", "prompt"])
def test_file_records_become_prompts_of_ctx_tokens(tmp_path, suffix, column):
    texts = [words(40, "a"), words(50, "b"), words(CTX, "c")]
    path = write_table(tmp_path / f"data{suffix}", column, texts)
    tok = WordTokenizer()
    prompts = load_prompts(tok, str(path), CTX, count=3)
    assert [p.name for p in prompts] == [f"file:data{suffix}:{i}" for i in range(3)]
    # Long records are truncated to their first ctx tokens, one prompt each.
    assert [p.ids for p in prompts] == [tok.encode(t)[:CTX] for t in texts]


def test_short_records_are_joined_in_file_order(tmp_path):
    texts = [words(10, "a"), "", words(10, "b"), "   ", words(20, "c"), words(CTX, "d")]
    path = write_table(tmp_path / "short.jsonl", "text", texts)
    tok = WordTokenizer()
    first, second = load_prompts(tok, str(path), CTX, count=2)
    # Blank records are dropped; a, b and c are joined, then cut at ctx.
    assert first.ids == tok.encode(" ".join(texts[i] for i in (0, 2, 4)))[:CTX]
    assert second.ids == tok.encode(texts[5])


def test_too_little_text_names_the_token_counts(tmp_path):
    path = write_table(tmp_path / "small.csv", "text", [words(20, "a"), words(30, "b")])
    with pytest.raises(VegasError) as err:
        load_prompts(WordTokenizer(), str(path), CTX, count=3)
    message = str(err.value)
    assert "50 tokens" in message and str(3 * CTX) in message
    assert "--ctx" in message and "--num-prompts" in message
    assert "\n" not in message


def test_missing_text_column_lists_the_columns(tmp_path):
    path = tmp_path / "other.csv"
    pd.DataFrame({"question": ["x"], "answer": ["y"]}).to_csv(path, index=False)
    with pytest.raises(VegasError, match="question, answer"):
        load_prompts(WordTokenizer(), str(path), CTX, count=1)


@pytest.mark.parametrize("name", ["missing.jsonl", "some/dir/data", "./corpus"])
def test_missing_file_is_reported_as_not_found(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VegasError, match="dataset file not found"):
        load_prompts(WordTokenizer(), name, CTX, count=1)


@pytest.mark.parametrize("name", ["someone/corpus", "someone/corpus:validation", "nosuchset"])
def test_hub_id_without_datasets_package_says_how_to_install(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(VegasError) as err:
        load_prompts(WordTokenizer(), name, CTX, count=1)
    assert "pip install datasets" in str(err.value)
    assert all(embedded in str(err.value) for embedded in EMBEDDED_DATASETS)


def test_hub_id_streams_the_split_and_text_column(monkeypatch):
    calls = []

    def load_dataset(hf_id, split, streaming):
        calls.append((hf_id, split, streaming))
        records = [{"prompt": words(CTX + 5, "a")}, {"prompt": None}, {"prompt": words(CTX, "b")}]
        return iter(records)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    tok = WordTokenizer()
    prompts = load_prompts(tok, "someone/corpus:test", CTX, count=2)
    assert calls == [("someone/corpus", "test", True)]
    assert [p.ids for p in prompts] == [tok.encode(words(CTX, "a")), tok.encode(words(CTX, "b"))]


@pytest.mark.parametrize("ctx, count", [(8, 1), (CTX, 0)])
def test_bad_sizes_are_rejected(ctx, count):
    with pytest.raises(VegasError):
        load_prompts(WordTokenizer(), "code", ctx, count)


def test_fingerprint_is_deterministic_and_sensitive():
    prompts = [Prompt("a", [1, 2, 3]), Prompt("b", [4, 5])]
    same = [Prompt("x", [1, 2, 3]), Prompt("y", [4, 5])]
    assert dataset_fingerprint(prompts) == dataset_fingerprint(same)
    assert len(dataset_fingerprint(prompts)) == 64
    one_token_changed = [Prompt("a", [1, 2, 3]), Prompt("b", [4, 6])]
    assert dataset_fingerprint(prompts) != dataset_fingerprint(one_token_changed)
    # Moving a token across a prompt boundary is a different workload.
    boundary_moved = [Prompt("a", [1, 2]), Prompt("b", [3, 4, 5])]
    assert dataset_fingerprint(prompts) != dataset_fingerprint(boundary_moved)
