"""Tokenizers behind one small interface: encode, decode, chat template, special ids."""

from __future__ import annotations

from typing import Any, Protocol

import jinja2


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: list[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


class TokenizersTokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token facts the model file states.

    Used for GGUF files, whose vocabulary, merges, BOS/EOS and chat template come from
    the file's metadata.
    """

    def __init__(self, backend: Any, *, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool, chat_template: str | None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            return messages[-1]["content"]
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        token = self.backend.id_to_token
        return template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=token(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=token(self.eos_token_ids[0]) if self.eos_token_ids else "",
        )


class TransformersTokenizer:
    """A tokenizer loaded by transformers (Hugging Face model directories)."""

    def __init__(self, tok: Any, eos_token_ids: list[int]) -> None:
        self.tok = tok
        self.bos_token_id = tok.bos_token_id
        extra = [tok.eos_token_id] if tok.eos_token_id is not None else []
        self.eos_token_ids = sorted(set(eos_token_ids) | set(extra))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.tok, "chat_template", None):
            return messages[-1]["content"]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class ByteTokenizer:
    """UTF-8 bytes as token ids, for dummy models that have no vocabulary of their own.

    Dummy outputs are meaningless by construction; this only lets text flow through.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = None
        self.eos_token_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return messages[-1]["content"]
