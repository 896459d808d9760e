"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as a `tokenizers` tokenizer.json, its
special tokens, its stop tokens, and its tokenizer_config.json (the chat template included).

- "gpt2": byte-level BPE with its merges and llama.cpp's pre-tokenizer named by
  `tokenizer.ggml.pre`;
- "llama": a SentencePiece BPE vocabulary (Gemma's), spaces as "▁", byte fallback; the
  file lists no merges, so they are rebuilt from the vocabulary: every split of a token into
  two tokens, in the order the tokens are listed (SentencePiece's BPE merges its pieces in
  that order), as transformers' converters rebuild them.

A vocabulary of another kind, or a pre-tokenizer not listed, is a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from jaxinfer.models.families.family import GGUFMetadata

# Control tokens that llama.cpp also treats as end of generation when the vocabulary has them.
END_OF_GENERATION_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
)

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), as `tokenizers` splits.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(pattern: str):
    return lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "qwen2": _split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split(_QWEN2_SPLIT),
    "llama3": _split(_LLAMA3_SPLIT),
    "llama-bpe": _split(_LLAMA3_SPLIT),
}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def generation_fields(meta: GGUFMetadata) -> dict[str, Any]:
    """config.json's token fields: bos, eos (one id) and the ids that end generation."""
    tokens = meta.require("tokenizer.ggml.tokens")
    token_types = meta.require("tokenizer.ggml.token_type")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    ids = [] if eos_id is None else [int(eos_id)]
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        ids.append(int(eot))
    for i, (text, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind == _TOKEN_TYPE_CONTROL and text in END_OF_GENERATION_TOKENS:
            ids.append(i)
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "stop_token_ids": sorted(set(ids))}


def write_tokenizer(meta: GGUFMetadata, out_dir: Path, max_len: int) -> None:
    """tokenizer.json and tokenizer_config.json into out_dir."""
    tokens = meta.require("tokenizer.ggml.tokens")
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    pad_id = meta.get("tokenizer.ggml.padding_token_id")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos_id] if bos_id is not None else None,
        "eos_token": tokens[eos_id] if eos_id is not None else None,
        "pad_token": tokens[pad_id] if pad_id is not None else None,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "model_max_length": max_len,
    }
    write_json(out_dir / "tokenizer_config.json", config)


def build_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    kind = meta.require("tokenizer.ggml.model")
    if kind == "llama":
        tokenizer = _sentencepiece_bpe(meta)
    elif kind == "gpt2":
        tokenizer = _byte_level_bpe(meta)
    else:
        raise ValueError(
            f"{meta.source}: tokenizer model {kind!r} is not supported (gpt2 byte-level BPE, "
            "llama SentencePiece BPE)"
        )
    _add_special_tokens(tokenizer, meta)
    return tokenizer


def _sentencepiece_bpe(meta: GGUFMetadata) -> Tokenizer:
    # a token of spaces alone is stored as spaces; the vocabulary spells them as "▁"
    tokens = [
        "\u2581" * len(t) if t and not t.strip(" ") else t
        for t in meta.require("tokenizer.ggml.tokens")
    ]
    vocab = {text: i for i, text in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(tokens),
            fuse_unk=True,
            unk_token=tokens[unk] if unk is not None else None,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tokenizer


def sentencepiece_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """The merges of a SentencePiece BPE vocabulary listed best first: for each token in
    turn, each split of it into two tokens of the vocabulary (longer left parts first)."""
    ranks = {text: i for i, text in enumerate(tokens)}
    merges = []
    for text in sorted(ranks, key=ranks.__getitem__):
        merges.extend(
            (text[:k], text[k:])
            for k in range(len(text) - 1, 0, -1)
            if text[:k] in ranks and text[k:] in ranks
        )
    return merges


def _byte_level_bpe(meta: GGUFMetadata) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"{meta.source}: pre-tokenizer {pre!r} is not supported ({', '.join(_PRE_TOKENIZERS)})"
        )
    tokens = meta.require("tokenizer.ggml.tokens")
    vocab = {text: i for i, text in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _add_special_tokens(tokenizer: Tokenizer, meta: GGUFMetadata) -> None:
    """Control tokens as special tokens; user-defined ones (<think>, ...) matched whole in
    text, as llama.cpp does."""
    tokens = meta.require("tokenizer.ggml.tokens")
    kinds = list(zip(tokens, meta.require("tokenizer.ggml.token_type"), strict=True))
    tokenizer.add_special_tokens(
        [
            AddedToken(text, special=True, normalized=False)
            for text, kind in kinds
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    vocab = tokenizer.get_vocab()  # (a SentencePiece file's space tokens are respelled)
    tokenizer.add_tokens(
        [
            AddedToken(text, special=False, normalized=False)
            for text, kind in kinds
            if kind == _TOKEN_TYPE_USER_DEFINED and text in vocab
        ]
    )


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
