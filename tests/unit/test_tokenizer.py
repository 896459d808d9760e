"""The tokenizer wrapper: BOS handling and chat-template rendering."""

from __future__ import annotations

import json

import pytest
from jinja2.exceptions import SecurityError, TemplateError

from jaxinfer.tokenizer import TokenizerWrapper
from tools.tiny_tokenizer import write_tiny_tokenizer


@pytest.fixture
def folder(tmp_path):
    write_tiny_tokenizer(tmp_path, vocab_size=320)
    return tmp_path


def set_config(folder, **changes):
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bos_added_once_for_plain_prompts_only(folder):
    set_config(folder, add_bos_token=True)
    tokenizer = TokenizerWrapper(folder)
    bos = tokenizer.bos_token_id
    plain = tokenizer.encode("hello world")
    assert plain[0] == bos and plain[1] != bos
    assert tokenizer.encode("<|im_start|>hello").count(bos) == 1  # no double BOS
    assert tokenizer.encode("hello", add_special_tokens=False)[0] != bos
    set_config(folder, add_bos_token=False)
    assert TokenizerWrapper(folder).encode("hello world")[0] != bos


def test_chat_template_renders_like_transformers(folder):
    set_config(
        folder,
        chat_template="{{ messages | tojson }}{% if add_generation_prompt %}>{% endif %}",
    )
    tokenizer = TokenizerWrapper(folder)
    messages = [{"role": "user", "content": "<b>ünï</b>"}]
    assert tokenizer.apply_chat_template(messages) == json.dumps(messages, ensure_ascii=False) + ">"


def test_template_errors_and_sandbox(folder):
    set_config(folder, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="roles must alternate"):
        TokenizerWrapper(folder).apply_chat_template([{"role": "user", "content": "x"}])
    set_config(folder, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        TokenizerWrapper(folder).apply_chat_template([])
    set_config(folder, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        TokenizerWrapper(folder).apply_chat_template([])
