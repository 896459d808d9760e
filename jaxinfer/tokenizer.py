"""The model's tokenizer (tokenizer.json through `tokenizers`) and its chat template."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise_exception(message: str):
    raise TemplateError(message)


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
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._env.filters["tojson"] = _tojson
        self._template = self._env.from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens (plain prompts), the tokenizer's own
        post-processor runs and a BOS is prepended when tokenizer_config asks for one; chat
        prompts pass False, since the template already wrote the special tokens as text."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> str:
        """Renders the model's chat template (or `chat_template`) in the sandbox; a template
        that fails raises jinja2's TemplateError (SecurityError when it breaks the sandbox)."""
        template = self._env.from_string(chat_template) if chat_template else self._template
        if template is None:
            raise ValueError("this model has no chat template")
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    """As transformers renders chat templates: plain JSON, no HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some tokenizer_config files
        return value.get("content")
    return value
