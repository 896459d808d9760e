"""The model's tokenizer (tokenizer.json through `tokenizers`) and its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from jaxinfer import chat_template


class TokenizerWrapper:
    def __init__(self, folder: Path):
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: tokenizer.json not found")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token = bool(config.get("add_bos_token")) and self.bos_token_id is not None
        self.chat_template = config.get("chat_template")
        env = chat_template.environment()
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens (plain prompts), the tokenizer's own
        post-processor runs and a BOS is prepended when tokenizer_config asks for one; chat
        prompts pass False, since the template already wrote the special tokens as text."""
        return self.encode_many([text], add_special_tokens)[0]

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text. The batch call releases the GIL while it tokenizes (a
        single `Tokenizer.encode` holds it), so a long input tokenized on a worker thread
        does not stall the server's event loop or the engine thread."""
        if not texts:
            return []
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        result = []
        for encoding in encodings:
            ids = encoding.ids
            if (
                add_special_tokens
                and self.add_bos_token
                and (not ids or ids[0] != self.bos_token_id)
            ):
                ids.insert(0, self.bos_token_id)
            result.append(ids)
        return result

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        max_chars: int | None = None,
        tools: list[dict] | None = None,
        extra: dict | None = None,
    ) -> str:
        """Renders the model's chat template in the sandbox; a template that fails raises
        jinja2's TemplateError (SecurityError when it breaks the sandbox) or whatever else
        its code raised, and one producing more than max_chars a ValueError. `extra`: more
        variables (a request's chat_template_kwargs)."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        variables = self.template_variables(messages, add_generation_prompt, tools, extra)
        if max_chars is None:
            return self._template.render(**variables)
        return chat_template.render_bounded(self._template, variables, max_chars)

    def template_variables(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        extra: dict | None = None,
    ) -> dict:
        """What a chat template renders from (`tools` as transformers passes them; `extra`
        beside them, never in place of one: a ValueError)."""
        variables = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        if tools is not None:
            variables["tools"] = tools
        taken = set(extra or ()) & {*variables, "tools"}
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {sorted(taken)}")
        return {**variables, **(extra or {})}


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some tokenizer_config files
        return value.get("content")
    return value
