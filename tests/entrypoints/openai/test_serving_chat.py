"""How a chat request's messages become token ids: the template's tokens, and with vLLM's
add_special_tokens (default false for messages) the tokenizer's special tokens (here a BOS) on top."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from checkpoints import make_bos_tokenizer

from fp8serve.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from fp8serve.entrypoints.openai.serving_chat import ChatServer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = make_bos_tokenizer(tmp_path_factory.mktemp("bos_tok"))
    return ChatServer(SimpleNamespace(engine=SimpleNamespace(tokenizer=tok), chat_template=TEMPLATE))


def test_the_template_alone_by_default_and_the_tokenizer_bos_on_request(server):
    tok = server.state.engine.tokenizer
    rendered = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    template_ids = tok.encode(rendered, add_special_tokens=False)
    assert template_ids[0] == 1 and len(template_ids) > 4  # the template writes <|im_start|> itself
    assert server.apply_chat_template(ChatCompletionRequest(messages=MESSAGES)) == template_ids
    with_bos = server.apply_chat_template(ChatCompletionRequest(messages=MESSAGES, add_special_tokens=True))
    assert with_bos == [1] + template_ids
    # /tokenize with messages takes the chat request's default (false); with a prompt, true (its own path).
    assert TokenizeRequest(messages=MESSAGES).add_special_tokens is None
    assert server.apply_chat_template(TokenizeRequest(messages=MESSAGES)) == template_ids
    assert server.apply_chat_template(TokenizeRequest(messages=MESSAGES, add_special_tokens=True)) == with_bos


def test_add_special_tokens_keeps_the_other_template_options(server):
    """continue_final_message and chat_template_kwargs still reach the template with the BOS on top."""
    conv = MESSAGES + [{"role": "assistant", "content": "Hi"}]
    open_ids = server.apply_chat_template(ChatCompletionRequest(messages=conv, continue_final_message=True,
                                                                add_special_tokens=True))
    tok = server.state.engine.tokenizer
    assert open_ids == [1] + tok.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi",
                                        add_special_tokens=False)
