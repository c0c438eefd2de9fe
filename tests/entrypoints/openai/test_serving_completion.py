"""How a completion request's text prompt becomes token ids: vLLM's add_special_tokens (default
true) decides whether the tokenizer's special tokens (here a BOS) go around it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from checkpoints import make_bos_tokenizer

from fp8serve.entrypoints.openai.protocol import CompletionRequest
from fp8serve.entrypoints.openai.serving_completion import CompletionServer


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    """The tests' byte-level BPE with a BOS (<|im_start|>, id 1) put before every text."""
    return make_bos_tokenizer(tmp_path_factory.mktemp("bos_tok"))


def test_add_special_tokens(bos_tokenizer):
    server = CompletionServer(SimpleNamespace(engine=SimpleNamespace(tokenizer=bos_tokenizer)))
    plain = bos_tokenizer.encode("Hello there", add_special_tokens=False)
    with_bos = server._prompts(CompletionRequest(prompt="Hello there"))[0].token_ids
    assert with_bos == [1] + plain and len(plain) > 1
    without = server._prompts(CompletionRequest(prompt=["Hello there", "Hello there"], add_special_tokens=False))
    assert [p.token_ids for p in without] == [plain, plain]
    # Token-id prompts are taken as they are.
    assert server._prompts(CompletionRequest(prompt=[7, 8]))[0].token_ids == [7, 8]
