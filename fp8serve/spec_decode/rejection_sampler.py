"""Checking drafted tokens against the model: which to keep, and the token after them.

A sequence with drafts d_0..d_{k-1} runs k + 1 positions in one forward pass:
its last token, then the drafts. Row j's logits give the model's distribution
p_j for the token after d_{j-1} (row 0: after the last token), each row
processed with its own sampling metadata (penalties and min_tokens counted as
if d_0..d_{j-1} were already generated).

Greedy rows keep drafts while each equals the argmax, then emit the argmax at
the first mismatch (or after the last draft): exactly greedy decoding's tokens.

Random rows use speculative sampling (Leviathan et al. 2023; Chen et al.
2023) with a draft that puts all its probability on d_j (an n-gram proposes
one token, q = one-hot): d_j is kept with probability p_j(d_j); at the first
rejection the emitted token is drawn from p_j with d_j removed (max(p - q, 0)
renormalized); if every draft is kept, one more token is drawn from p_k. Each
emitted token is then distributed exactly as plain sampling's would be, so
outputs keep their distribution; a seeded request is reproducible but draws
other tokens than it would without drafts (the randomness is spent
differently), as in vLLM.

On CPU with the C++ kernels, p_j(d_j) and the draw without d_j come from the
sampler's kernel (kernels/cpu/random_sampling.cpp) in a few passes per row;
elsewhere from the torch path (sorted filtering, the exponential race): 37x
for one sequence with 4 drafts on the default model
(benchmarks/results/sampler_2026-12-02_zen3.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8serve.kernels import cpu_ops
from fp8serve.layers.sampler import Sampler, SamplingMetadata, exponential_race, row_uniforms
from fp8serve.sampling_params import SAMPLING_EPS


@dataclass
class VerifyResult:
    # Per sequence: the kept drafts followed by the emitted token (1 to k + 1 tokens).
    token_ids: list[list[int]]
    # Per row of the verify pass: the token that row's position produced (a
    # kept draft or the emitted token; rows after the emitted one hold
    # their draft and are unused), for the logprobs of the tokens kept.
    row_token_ids: torch.Tensor


def rejection_sample(logits: torch.Tensor, metadata: SamplingMetadata,
                     draft_token_ids: list[list[int]]) -> VerifyResult:
    """logits: [sum(len(d) + 1 for d in draft_token_ids), vocab], the rows of
    each sequence consecutive; metadata: one row per logits row."""
    num_rows = sum(len(d) + 1 for d in draft_token_ids)
    if logits.shape[0] != num_rows or metadata.num_seqs != num_rows:
        raise ValueError(f"expected {num_rows} rows of logits and metadata, got {logits.shape[0]} and "
                         f"{metadata.num_seqs}")
    device = logits.device
    # Each row's draft (the token its position is checked against); the last
    # row of a sequence has none (-1).
    drafts_flat: list[int] = []
    for drafts in draft_token_ids:
        drafts_flat.extend(drafts)
        drafts_flat.append(-1)
    draft_rows = torch.tensor(drafts_flat, dtype=torch.int64, device=device)
    has_draft = draft_rows >= 0

    logits = Sampler.process_logits(logits, metadata)
    greedy = None if metadata.all_random else cpu_ops.greedy_argmax(logits)
    if metadata.all_greedy:
        accepted = greedy == draft_rows
        emitted = greedy
    else:
        # Uniforms for the acceptance test: seeded rows draw theirs first from
        # their own generator (before the emitted-token draw below), the others
        # from the global RNG. A row without a draft draws nothing here, so a
        # seeded sequence without drafts samples what a plain decode step would.
        uniform = torch.rand(num_rows, device=device)
        for row, gen in metadata.generators.items():
            if drafts_flat[row] >= 0:
                uniform[row] = torch.rand(1, generator=gen, device=device)[0]
        fast = None
        if cpu_ops.sample_tokens_applies(logits):
            # The C++ kernel (Sampler.sample_random's): p(draft) under each row's
            # kept distribution, and the emitted token drawn without the draft
            # (rows with one) or as a plain step draws it (rows without).
            fast = cpu_ops.sample_tokens_excluding(logits, metadata.temperature, metadata.top_k, metadata.top_p,
                                                   metadata.min_p, row_uniforms(metadata), draft_rows)
            if bool((fast[0] == -1).any()):
                fast = None  # a row for the torch path (a NaN, or no finite logit): all rows go there
        if fast is not None:
            emitted, p_draft = fast
            accepted = has_draft & (uniform.double() < p_draft)
        else:
            probs = Sampler.random_probs(logits, metadata)  # [rows, vocab], rows may be unnormalized (min-p)
            safe_drafts = draft_rows.clamp(min=0).unsqueeze(-1)
            p_draft = probs.gather(-1, safe_drafts).squeeze(-1) / probs.sum(-1)
            accepted = has_draft & (uniform < p_draft)
            # The token emitted at a row: drawn from p with the row's draft removed
            # (only used when the draft was rejected, so p(draft) < 1 and something
            # is left), or from p itself on a sequence's last row.
            probs.scatter_(-1, safe_drafts, torch.where(has_draft.unsqueeze(-1), 0.0,
                                                        probs.gather(-1, safe_drafts)))
            emitted = exponential_race(probs, metadata.generators)
        if greedy is not None:
            is_greedy = metadata.temperature < SAMPLING_EPS
            accepted = torch.where(is_greedy, greedy == draft_rows, accepted)
            emitted = torch.where(is_greedy, greedy, emitted)

    accepted_l, emitted_l = accepted.tolist(), emitted.tolist()
    token_ids: list[list[int]] = []
    row_tokens = list(drafts_flat)
    row = 0
    for drafts in draft_token_ids:
        kept = 0
        while kept < len(drafts) and accepted_l[row + kept]:
            kept += 1
        out = drafts[:kept] + [emitted_l[row + kept]]
        row_tokens[row + kept] = emitted_l[row + kept]
        token_ids.append(out)
        row += len(drafts) + 1
    return VerifyResult(token_ids, torch.tensor(row_tokens, dtype=torch.int64, device=device).clamp(min=0))
