"""Batched token sampling: penalties, greedy/random selection, top-k/top-p/min-p, logprobs.

Every operation runs on the whole batch at once; the only per-row Python work is drawing
noise for rows that carry their own seed, so a seeded request samples the same tokens no
matter which other requests share its batch.

Order of operations (vLLM v1 semantics): logprobs come from the raw model logits, then
logit_bias, penalties, banned tokens, then greedy argmax or temperature -> top-k -> top-p ->
min-p -> softmax -> one draw per row.

The draw: on CPU with the C++ kernels, `cpu_ops.sample_tokens` (kernels/cpu/random_sampling.cpp)
filters each row in a few passes without sorting it and draws by inverse CDF with one uniform
per row; elsewhere (and for rows with a NaN or no finite logit) the torch path: a sort for
top-k/top-p, softmax, and the exponential race (argmax of p / E, one E ~ Exp(1) per token).
Both sample the same distribution: the kept tokens' softmax at the row's temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8serve.kernels import cpu_ops
from fp8serve.sampling_params import SAMPLING_EPS, SamplingParams

# Padding for the ragged token-id matrices used by the penalties.
PAD_TOKEN_ID = -1

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingMetadata:
    """Per-step sampling state for a batch; built once per engine step by the model runner."""

    temperature: torch.Tensor  # [num_seqs] float32; 0.0 = greedy
    top_p: torch.Tensor  # [num_seqs] float32; 1.0 = off
    top_k: torch.Tensor  # [num_seqs] int64; 0 = off
    min_p: torch.Tensor  # [num_seqs] float32; 0.0 = off
    generators: dict[int, torch.Generator]  # row -> generator, seeded rows only
    # None = no row wants logprobs; 0 = only the sampled token's logprob (vLLM's logprobs=0).
    max_num_logprobs: int | None
    all_greedy: bool
    all_random: bool
    no_top_p: bool
    no_top_k: bool
    no_min_p: bool
    # Penalties; all None when every row is neutral. Token ids are padded with PAD_TOKEN_ID.
    prompt_token_ids: torch.Tensor | None = None  # [num_seqs, max_prompt_len] int64
    output_token_ids: torch.Tensor | None = None  # [num_seqs, max_output_len] int64
    repetition_penalty: torch.Tensor | None = None  # [num_seqs] float32
    presence_penalty: torch.Tensor | None = None  # [num_seqs] float32
    frequency_penalty: torch.Tensor | None = None  # [num_seqs] float32
    # Token ids masked to -inf this step, per row (min_tokens not yet reached); None if none.
    banned_token_ids: list[list[int]] | None = None
    # Every row's logit_bias as (rows, token ids, biases), flattened; None if no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        num_seqs = self.temperature.shape[0]
        for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and value.shape != (num_seqs,):
                raise ValueError(f"{name} must have shape ({num_seqs},), got {tuple(value.shape)}.")
        penalties = (self.prompt_token_ids, self.output_token_ids, self.repetition_penalty,
                     self.presence_penalty, self.frequency_penalty)
        if any(p is None for p in penalties) and any(p is not None for p in penalties):
            raise ValueError("penalty tensors must be all set or all None.")
        if self.banned_token_ids is not None and len(self.banned_token_ids) != num_seqs:
            raise ValueError(f"banned_token_ids must have {num_seqs} rows, got {len(self.banned_token_ids)}.")
        if self.max_num_logprobs is not None and self.max_num_logprobs < 0:
            raise ValueError(f"max_num_logprobs must be non-negative or None, got {self.max_num_logprobs}.")
        for row in self.generators:
            if not 0 <= row < num_seqs:
                raise ValueError(f"generators has row {row}, outside a batch of {num_seqs}.")

    @property
    def num_seqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty is not None

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy with nothing applied to its logits first: the
        token is the argmax of the raw logits."""
        return (self.all_greedy and not self.has_penalties and self.banned_token_ids is None
                and self.logit_bias is None)

    @property
    def depends_on_step(self) -> bool:
        """Whether the next step of the same rows needs new metadata: seeded rows
        draw from a per-step generator, penalties count the tokens so far and
        min_tokens bans end when enough tokens are out. Without those it is a
        function of the rows' SamplingParams alone."""
        return bool(self.generators) or self.has_penalties or self.banned_token_ids is not None

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_id: int | None,
        device: torch.device | str,
        generators: dict[int, torch.Generator] | None = None,
    ) -> "SamplingMetadata":
        """Builds the metadata for one step; row i is params[i] with its tokens so far.

        Seeded rows get a generator seeded from (seed, number of tokens generated so far)
        unless the caller passes persistent ``generators``. The derived seed makes a
        request's samples a pure function of its seed and position, so they survive
        batching changes and preemption-with-recompute alike.
        """
        num_seqs = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == num_seqs):
            raise ValueError(
                f"params, prompt_token_ids and output_token_ids must have equal lengths, got "
                f"{num_seqs}, {len(prompt_token_ids)}, {len(output_token_ids)}."
            )
        device = torch.device(device)

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.is_greedy for p in params]
        if generators is None:
            generators = {
                i: _step_generator(p.seed, len(output_token_ids[i]), device)
                for i, p in enumerate(params)
                if p.seed is not None and not p.is_greedy
            }
        requested = [p.logprobs for p in params if p.logprobs is not None]

        penalties: dict[str, torch.Tensor | None] = dict.fromkeys(
            ("prompt_token_ids", "output_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty")
        )
        if any(p.has_penalties for p in params):
            penalties = dict(
                prompt_token_ids=_pad(prompt_token_ids, device),
                output_token_ids=_pad(output_token_ids, device),
                repetition_penalty=column([p.repetition_penalty for p in params], torch.float32),
                presence_penalty=column([p.presence_penalty for p in params], torch.float32),
                frequency_penalty=column([p.frequency_penalty for p in params], torch.float32),
            )

        banned = [_banned_ids(p, len(out), eos_token_id) for p, out in zip(params, output_token_ids)]
        bias = None
        if any(p.logit_bias for p in params):
            entries = [(row, t, b) for row, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
            bias = (column([e[0] for e in entries], torch.int64), column([e[1] for e in entries], torch.int64),
                    column([e[2] for e in entries], torch.float32))

        return cls(
            temperature=column([0.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            top_p=column([p.top_p for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.int64),
            min_p=column([p.min_p for p in params], torch.float32),
            generators=generators,
            max_num_logprobs=max(requested) if requested else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_top_k=all(p.top_k == 0 for p in params),
            no_min_p=all(p.min_p <= 0.0 for p in params),
            banned_token_ids=banned if any(banned) else None,
            logit_bias=bias,
            **penalties,
        )


def _banned_ids(params: SamplingParams, num_output_tokens: int, eos_token_id: int | None) -> list[int]:
    # Until min_tokens are out, nothing that would end the sequence may be sampled. With
    # ignore_eos the EOS token does not end it, so it stays allowed (as in vLLM).
    if num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        banned.append(eos_token_id)
    return banned


def _pad(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [PAD_TOKEN_ID] * (width - len(r)) for r in rows], dtype=torch.int64,
                        device=device).reshape(len(rows), width)


def _step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    # splitmix64 over (seed, step): nearby seeds and steps give unrelated streams.
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    gen = torch.Generator(device=device)
    gen.manual_seed(z)
    return gen


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_seqs] int64
    logprobs: torch.Tensor | None  # [num_seqs] float32, raw-logit logprob of the sampled token
    ranks: torch.Tensor | None  # [num_seqs] int64, 1-based rank of the sampled token
    top_logprobs: torch.Tensor | None  # [num_seqs, max_num_logprobs] float32
    top_token_ids: torch.Tensor | None  # [num_seqs, max_num_logprobs] int64


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob and 1-based rank of each target token, plus the num_top best per row.

    logits: [n, vocab]; target_ids: [n]. Returns ([n], [n], [n, num_top], [n, num_top]).
    Used both for prompt_logprobs (targets = next prompt tokens) and for sampled tokens.
    """
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise ValueError(f"expected logits [n, vocab] and target_ids [n], got {tuple(logits.shape)} "
                         f"and {tuple(target_ids.shape)}.")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_logprobs = logprobs.gather(-1, target_ids.long().unsqueeze(-1))  # [n, 1]
    # Ties share the best rank, so a token tied with the argmax is rank 1.
    ranks = (logprobs > target_logprobs).sum(dim=-1) + 1
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    else:
        top_logprobs = logprobs.new_empty((logits.shape[0], 0))
        top_ids = torch.empty((logits.shape[0], 0), dtype=torch.int64, device=logits.device)
    return target_logprobs.squeeze(-1), ranks, top_logprobs, top_ids


class Sampler(torch.nn.Module):
    def __init__(self, use_kernel: bool = True) -> None:
        super().__init__()
        # False: always the torch path (tests and benchmarks compare the two).
        self.use_kernel = use_kernel

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [num_seqs, vocab_size], any float dtype; never modified in place.
        raw_logits = logits
        logits = self.process_logits(logits, metadata)
        # Taken before the random path, which rescales and masks logits in place.
        # max(dim).indices semantics (first index on ties, NaN wins); on CPU one
        # C++ pass (kernels/cpu/sampling_ops.cpp), where torch's max(dim) took
        # 0.9 ms and argmax 2.5 ms for 64 x 49152 logits.
        greedy = None if metadata.all_random else cpu_ops.greedy_argmax(logits)
        if metadata.all_greedy:
            sampled = greedy
        else:
            sampled = self.sample_random(logits, metadata)
            if greedy is not None:
                sampled = torch.where(metadata.temperature < SAMPLING_EPS, greedy, sampled)

        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None, None)
        token_logprobs, ranks, top_logprobs, top_ids = compute_prompt_logprobs(
            raw_logits, sampled, metadata.max_num_logprobs
        )
        return SamplerOutput(sampled, token_logprobs, ranks, top_logprobs, top_ids)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logit_bias, penalties and banned tokens applied: a float32 copy, or
        the logits themselves where no row needs any of it and every row is
        greedy (the argmax of a float32 copy is the same)."""
        if logits.dim() != 2 or logits.shape[0] != metadata.num_seqs:
            raise ValueError(f"logits must be [{metadata.num_seqs}, vocab], got {tuple(logits.shape)}.")
        if metadata.plain_greedy:
            return logits
        logits = logits.to(torch.float32, copy=True)
        if metadata.logit_bias is not None:
            logits = apply_logit_bias(logits, metadata.logit_bias)
        if metadata.has_penalties:
            logits = apply_penalties(logits, metadata)
        if metadata.banned_token_ids is not None:
            logits = apply_banned_tokens(logits, metadata.banned_token_ids)
        return logits

    def sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """One draw per row from processed float32 logits (which it may
        overwrite); greedy rows of a mixed batch get a value the caller
        replaces. The C++ kernel where it serves, else the torch path."""
        if self.use_kernel and cpu_ops.sample_tokens_applies(logits):
            sampled = cpu_ops.sample_tokens(logits, metadata.temperature, metadata.top_k, metadata.top_p,
                                            metadata.min_p, row_uniforms(metadata))
            if not bool((sampled == -1).any()):
                return sampled
        return exponential_race(self.random_probs(logits, metadata), metadata.generators)

    @staticmethod
    def random_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Each row's sampling distribution from processed logits (rescaled and
        masked in place): temperature, top-k, top-p, softmax, min-p. Rows may be
        unnormalized after min-p. Greedy rows in a mixed batch still flow
        through here (their result is replaced); a temperature of 1 keeps them
        finite."""
        temperature = metadata.temperature
        if not metadata.all_random:
            temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        logits = logits.div_(temperature.unsqueeze(-1))
        if not (metadata.no_top_k and metadata.no_top_p):
            logits = apply_top_k_top_p(logits, None if metadata.no_top_k else metadata.top_k,
                                       None if metadata.no_top_p else metadata.top_p)
        probs = torch.softmax(logits, dim=-1)
        if not metadata.no_min_p:
            probs = apply_min_p(probs, metadata.min_p)
        return probs


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens; presence/frequency over output tokens.

    Only the (row, token) entries a row has seen change, so only those are
    touched: the same float32 operations as `apply_penalties_dense` on them
    (bit-identical results). Why: the dense form builds and combines several
    [rows, vocab] tensors: with the default model's 49152 tokens, 256 prompt and
    32 output tokens per row, 4.2 ms at 16 rows and 20.6 ms at 64 against 0.8 and
    3.0 ms this way (benchmarks/results/sampler_2026-12-02_zen3.md)."""
    num_seqs, vocab_size = logits.shape
    prompt = metadata.prompt_token_ids
    output = metadata.output_token_ids

    def keys(ids: torch.Tensor) -> torch.Tensor:  # flat indices row * vocab + id of the non-pad entries
        valid = ids != PAD_TOKEN_ID
        bad = ids[valid]
        if bad.numel() and not (0 <= int(bad.min()) and int(bad.max()) < vocab_size):
            raise ValueError(f"penalty token ids must be in [0, {vocab_size}), got {int(bad.min())}..{int(bad.max())}.")
        rows = torch.arange(num_seqs, device=ids.device).unsqueeze(1).expand_as(ids)
        return rows[valid] * vocab_size + ids[valid]

    out_keys, out_counts = torch.unique(keys(output), return_counts=True)
    seen = torch.unique(torch.cat([keys(prompt), out_keys]))
    logits = logits.contiguous()
    flat = logits.view(-1)
    values = flat[seen]
    rep = metadata.repetition_penalty[seen // vocab_size]
    flat[seen] = torch.where(values > 0, values / rep, values * rep)
    rows = out_keys // vocab_size
    values = flat[out_keys] - metadata.frequency_penalty[rows] * out_counts.to(torch.float32)
    flat[out_keys] = values - metadata.presence_penalty[rows]  # every output key has a count > 0
    return logits


def apply_penalties_dense(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """`apply_penalties` over whole [rows, vocab] tensors: the reference it is tested against."""
    vocab_size = logits.shape[-1]
    output_counts = _token_counts(metadata.output_token_ids, vocab_size)  # [num_seqs, vocab]
    prompt_seen = _token_counts(metadata.prompt_token_ids, vocab_size) > 0
    seen = prompt_seen | (output_counts > 0)

    rep = metadata.repetition_penalty.unsqueeze(-1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits -= metadata.frequency_penalty.unsqueeze(-1) * output_counts
    logits -= metadata.presence_penalty.unsqueeze(-1) * (output_counts > 0).float()
    return logits


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # Padding goes to an extra column that is dropped afterwards.
    num_seqs = token_ids.shape[0]
    counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.float32, device=token_ids.device)
    index = torch.where(token_ids == PAD_TOKEN_ID, vocab_size, token_ids)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    rows, token_ids, values = bias
    vocab_size = logits.shape[-1]
    if token_ids.numel() and not (0 <= int(token_ids.min()) and int(token_ids.max()) < vocab_size):
        # The engine rejects such requests; checked here too because an out-of-range
        # index is a device-side assert on CUDA.
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {sorted(set(token_ids.tolist()))}.")
    logits.index_put_((rows, token_ids), values, accumulate=True)
    return logits


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: list[list[int]]) -> torch.Tensor:
    rows = [row for row, ids in enumerate(banned_token_ids) for _ in ids]
    cols = [t for ids in banned_token_ids for t in ids]
    vocab_size = logits.shape[-1]
    if any(not 0 <= t < vocab_size for t in cols):
        # Checked here because an out-of-range index is a device-side assert on CUDA.
        raise ValueError(f"banned token ids must be in [0, {vocab_size}), got {sorted(set(cols))}.")
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks logits outside each row's top-k and top-p sets with -inf (0 / 1.0 = off).

    One ascending sort serves both filters; rows keep at least their best token.
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
        # Value of the k-th largest token; ties with it are kept.
        threshold = sorted_logits.gather(-1, (vocab_size - k).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        # Drop the low tail whose total mass is <= 1 - p; the top token is never dropped.
        drop = cumulative <= (1.0 - top_p).unsqueeze(-1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return logits.scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes tokens whose probability is below min_p times the row's top probability."""
    threshold = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def row_uniforms(metadata: SamplingMetadata) -> torch.Tensor:
    """float64 [num_seqs] in [0, 1), one per row: seeded rows from their own
    generator, so their draw does not depend on the batch; the others from the
    global RNG (drawn only where some row needs it)."""
    rows = metadata.num_seqs
    gens = metadata.generators
    device = metadata.temperature.device
    u = (torch.rand(rows, dtype=torch.float64, device=device) if len(gens) < rows
         else torch.empty(rows, dtype=torch.float64, device=device))
    for row, gen in gens.items():
        u[row] = torch.rand((), dtype=torch.float64, generator=gen, device=gen.device)
    return u


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Samples one token per row: argmax(p / E) with E ~ Exp(1) is a draw from p.

    Seeded rows draw E from their own generator over a full row, so their noise does
    not depend on the batch; the other rows share the global RNG. Unnormalized
    probs are fine (the argmax is scale-invariant).
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    # exponential_ can return exactly 0; 0/0 would be NaN and win the argmax.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)
