"""A tiny model of the engine's own layers for the weight-packing tests: a
bf16 embedding, a merged bf16 linear, a float32 linear and an LM head tied to
the embedding, with random weights."""

from __future__ import annotations

import torch


def tiny_bf16_model() -> torch.nn.Module:
    from fp8serve.layers.linear import MergedLinear
    from fp8serve.layers.vocab_embedding import LMHead, VocabEmbedding

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = VocabEmbedding(50, 32, torch.bfloat16)
            self.qkv = MergedLinear(32, [32, 16, 16], params_dtype=torch.bfloat16)
            self.f32 = MergedLinear(32, [8], params_dtype=torch.float32)
            self.head = LMHead(50, 32, torch.bfloat16, tied_to=self.embed)

    model = Tiny()
    for p in model.parameters():
        p.data.normal_()
    return model
