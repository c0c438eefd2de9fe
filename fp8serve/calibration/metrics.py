"""How far a KV cache configuration moves the model from a reference run.

Over teacher-forced positions that have a next token (0..n-2 of each chunk):
- mean KL(ref || cfg) per token, from log_softmax in float64 (in float32 the
  cancellation in p * (log p - log q) leaves ~1e-7 of noise per token, the
  size of the effect a good e4m3 configuration has);
- top-1 agreement: share of positions whose argmax is the same;
- perplexity of the true next token under each, and the relative change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class KLStats:
    num_tokens: int = 0
    kl_sum: float = 0.0
    num_top1_agree: int = 0
    nll_ref_sum: float = 0.0
    nll_cfg_sum: float = 0.0

    def update(self, ref_logits: torch.Tensor, cfg_logits: torch.Tensor, token_ids: list[int]) -> None:
        """ref/cfg logits: [n, vocab] for the n tokens of one chunk."""
        n = len(token_ids) - 1
        if n < 1:
            return
        ref = torch.log_softmax(ref_logits[:n].to(torch.float64), dim=-1)
        cfg = torch.log_softmax(cfg_logits[:n].to(torch.float64), dim=-1)
        targets = torch.tensor(token_ids[1:], dtype=torch.long, device=ref.device).unsqueeze(1)
        kl = (ref.exp() * (ref - cfg)).sum(dim=-1)  # [n]
        self.kl_sum += float(kl.sum())
        self.num_top1_agree += int((ref.argmax(dim=-1) == cfg.argmax(dim=-1)).sum())
        self.nll_ref_sum -= float(ref.gather(1, targets).sum())
        self.nll_cfg_sum -= float(cfg.gather(1, targets).sum())
        self.num_tokens += n

    @property
    def kld_mean(self) -> float:
        return self.kl_sum / self.num_tokens

    @property
    def top1_agreement(self) -> float:
        """Percent."""
        return 100.0 * self.num_top1_agree / self.num_tokens

    @property
    def ppl_ref(self) -> float:
        return math.exp(self.nll_ref_sum / self.num_tokens)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_cfg_sum / self.num_tokens)

    @property
    def ppl_rel_change(self) -> float:
        """(ppl - ppl_ref) / ppl_ref, a fraction (0.005 = +0.5%)."""
        return self.ppl / self.ppl_ref - 1.0
