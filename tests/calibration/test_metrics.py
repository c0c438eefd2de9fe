"""KLStats against a direct float64 computation on random logits."""

from __future__ import annotations

import math

import pytest
import torch

from fp8serve.calibration.metrics import KLStats


def test_matches_direct_computation():
    g = torch.Generator().manual_seed(0)
    chunks = [[int(t) for t in torch.randint(0, 50, (n,), generator=g)] for n in (9, 5)]
    stats = KLStats()
    kl, agree, nll_r, nll_c, n = 0.0, 0, 0.0, 0.0, 0
    for ids in chunks:
        ref = torch.randn(len(ids), 50, generator=g) * 3
        cfg = ref + 0.3 * torch.randn(len(ids), 50, generator=g)
        stats.update(ref, cfg, ids)
        for i in range(len(ids) - 1):
            p = torch.softmax(ref[i].double(), -1)
            q = torch.softmax(cfg[i].double(), -1)
            kl += float((p * (p.log() - q.log())).sum())
            agree += int(p.argmax() == q.argmax())
            nll_r -= math.log(p[ids[i + 1]])
            nll_c -= math.log(q[ids[i + 1]])
            n += 1
    assert stats.num_tokens == n == 12
    assert stats.kld_mean == pytest.approx(kl / n, rel=1e-9)
    assert stats.top1_agreement == pytest.approx(100 * agree / n)
    assert stats.ppl_ref == pytest.approx(math.exp(nll_r / n), rel=1e-9)
    assert stats.ppl == pytest.approx(math.exp(nll_c / n), rel=1e-9)
    assert stats.ppl_rel_change == pytest.approx(stats.ppl / stats.ppl_ref - 1)


def test_identical_logits_give_zero():
    logits = torch.randn(6, 30)
    stats = KLStats()
    stats.update(logits, logits.clone(), [1, 2, 3, 4, 5, 6])
    assert stats.kld_mean == 0.0 and stats.top1_agreement == 100.0 and stats.ppl_rel_change == 0.0
    stats.update(logits[:1], logits[:1], [7])  # one token predicts nothing
    assert stats.num_tokens == 5
