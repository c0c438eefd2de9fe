"""Llama through the whole engine, against Hugging Face transformers.

Our logits are captured where the engine computes them (the model's `compute_logits`, called by
`ModelRunner.execute`), for the prefill and for every decode step of several prompts batched
together, and compared with transformers in float64 on the same checkpoint.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch

from checkpoints import legacy_rope_config, load_hf_model, read_config, rewrite_config, write_tiny_llama
from engine_runs import assert_greedy_batch_invariant
from fp8serve.default_model import ensure_default_model
from fp8serve.entrypoints.llm import LLM
from fp8serve.sampling_params import SamplingParams

ATOL = 1e-3
KV_CACHE_MEMORY = 1 << 20  # 64+ blocks of the tiny models: never the limit unless a test says so

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that scaling changes the frequencies the tiny model uses at short positions.
    "original_max_position_embeddings": 32,
}


# ------------------------------------------------------------------------------------ recording
@dataclass
class Step:
    logits: torch.Tensor  # [vocab] float32, as the sampler received it
    is_prefill: bool
    batch_size: int
    num_preemptions: int  # of this sequence, before this step


class LogitsRecorder:
    """Records, per request, the logits row of every step, keyed by the sequence's token count.

    `execute` receives the scheduled Sequences, so the row of each is known; the first
    `compute_logits` call inside it is the one whose rows are sampled (later calls, for
    prompt_logprobs, are not recorded). Both wrappers return the real results. Every step
    must compute its logits, so the exact greedy head (which finds greedy tokens without
    them; tests/kernels/test_screened_argmax.py) is turned off.
    """

    def __init__(self, llm: LLM) -> None:
        runner = llm.llm_engine.model_runner
        self.steps: dict[str, dict[int, Step]] = defaultdict(dict)
        real_execute, real_compute_logits = runner.execute, runner.model.compute_logits
        pending: list = []  # (seqs, is_prefill) of the execute call in progress

        def compute_logits(hidden_states):
            logits = real_compute_logits(hidden_states)
            if pending:
                seqs, is_prefill = pending.pop()
                assert logits.shape[0] == len(seqs)
                for row, seq in enumerate(seqs):
                    assert seq.num_tokens not in self.steps[seq.request_id], "a position was sampled twice"
                    self.steps[seq.request_id][seq.num_tokens] = Step(
                        logits[row].detach().to("cpu", copy=True), is_prefill, len(seqs), seq.num_preemptions)
            return logits

        def execute(seqs, is_prefill, eos_token_id, *args):
            pending[:] = [(list(seqs), is_prefill)]
            out = real_execute(seqs, is_prefill, eos_token_id, *args)
            assert not pending, "execute did not compute logits"
            return out

        runner.model.compute_logits = compute_logits
        runner.model.compute_greedy_tokens = lambda hidden_states: None
        runner.execute = execute


@torch.no_grad()
def hf_step_logits(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Row i is transformers' next-token logits after prompt + generated[:i].   # [len(generated), vocab]

    One causal forward over the whole sequence: its row at position len(prompt) - 1 + i sees
    exactly prompt + generated[:i], so it is `hf_logits(dir, prompt + generated[:i])[-1]`.
    """
    ids = torch.tensor([prompt + generated[:-1]])
    return hf_model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:]


def assert_matches_hf(model_dir, outputs, recorder: LogitsRecorder, atol: float = ATOL,
                      exact_greedy_ids: tuple[str, ...] = ()) -> None:
    """Every recorded row within `atol` of transformers. For requests in `exact_greedy_ids` the
    tokens must equal transformers' greedy continuation exactly: by induction over the steps,
    that is the same as each token being the argmax of the reference row for our prefix."""
    hf_model = load_hf_model(model_dir, torch.float64)
    for out in outputs:
        prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
        steps = recorder.steps[out.request_id]
        # One recorded row per generated token, at positions prompt_len ... prompt_len + n - 1.
        assert sorted(steps) == list(range(len(prompt), len(prompt) + len(generated))), out.request_id
        ours = torch.stack([steps[n].logits for n in sorted(steps)]).double()
        ref = hf_step_logits(hf_model, prompt, generated)
        err = (ours - ref).abs().amax(dim=-1)
        bad = (err > atol).nonzero().flatten().tolist()
        assert not bad, (
            f"{out.request_id} (prompt of {len(prompt)} tokens): max |dlogit| {err.max():.2e} > {atol}; "
            f"first bad step {bad[0]} ({'prefill' if steps[len(prompt) + bad[0]].is_prefill else 'decode'})"
        )
        # Greedy picked the reference argmax, up to ties that the tolerance allows to swap.
        chosen = ref.gather(1, torch.tensor(generated)[:, None]).squeeze(1)
        assert (ref.amax(dim=-1) - chosen).max() <= 2 * atol, f"{out.request_id}: not the greedy token"
        if out.request_id in exact_greedy_ids:
            assert generated == ref.argmax(dim=-1).tolist(), f"{out.request_id}: differs from HF greedy"


# ---------------------------------------------------------------------------------- the cases
# Lengths 1 (no context), 7, 16 (exactly one block) and 23 (crosses a block); max_num_seqs=3 makes
# the fourth prompt join after the third finishes, i.e. a prefill between others' decode steps.
PROMPT_LENGTHS = (1, 7, 16, 23)
MAX_TOKENS = (10, 14, 6, 12)


def _prompts(vocab_size: int = 512, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab_size, (n,), generator=g).tolist()}
            for n in PROMPT_LENGTHS]


def run_recorded(model_dir, prompts, max_tokens, reserve_growth: bool = True, **llm_kwargs):
    llm_kwargs = {"dtype": "float32", "kv_cache_memory": KV_CACHE_MEMORY, **llm_kwargs}
    llm = LLM(str(model_dir), **llm_kwargs)
    llm.llm_engine.scheduler.reserve_growth = reserve_growth  # False: admit on the watermark alone (vLLM's)
    recorder = LogitsRecorder(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, outputs, recorder


def _write_sharded(d):
    write_tiny_llama(d, max_shard_size="100KB")
    assert len(list(d.glob("model-*.safetensors"))) > 1 and (d / "model.safetensors.index.json").is_file()


def _write_legacy_llama3(d):
    write_tiny_llama(d, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    cfg = legacy_rope_config(d)
    assert "rope_parameters" not in cfg and cfg["rope_scaling"]["rope_type"] == "llama3"


def _write_legacy_type_spelling(d):
    # Pre-4.45 configs say "type" where newer ones say "rope_type".
    write_tiny_llama(d, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    cfg = legacy_rope_config(d)
    scaling = dict(cfg["rope_scaling"])
    scaling["type"] = scaling.pop("rope_type")
    rewrite_config(d, rope_scaling=scaling)


CHECKPOINTS = {
    "gqa_4q_2kv": lambda d: write_tiny_llama(d),
    "mqa_1kv": lambda d: write_tiny_llama(d, num_kv_heads=1),
    "mha_4kv": lambda d: write_tiny_llama(d, num_kv_heads=4),
    "tied_embeddings": lambda d: write_tiny_llama(d, tie_word_embeddings=True),
    "llama3_rope": lambda d: write_tiny_llama(d, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "legacy_rope_spelling": _write_legacy_llama3,
    "legacy_rope_type_key": _write_legacy_type_spelling,
    "sharded": _write_sharded,
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_transformers_at_every_step(tmp_path, name):
    model_dir = tmp_path / name
    CHECKPOINTS[name](model_dir)
    _, outputs, recorder = run_recorded(model_dir, _prompts(), MAX_TOKENS, max_num_seqs=3)
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(MAX_TOKENS)
    assert_matches_hf(model_dir, outputs, recorder)
    # The run exercised what the test claims: batched decode, and a prefill after decoding began.
    all_steps = [s for steps in recorder.steps.values() for s in steps.values()]
    assert max(s.batch_size for s in all_steps if not s.is_prefill) >= 3
    late = recorder.steps[outputs[3].request_id][PROMPT_LENGTHS[3]]
    assert late.is_prefill and late.batch_size == 1


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gqa_4q_2kv", "tied_embeddings", "llama3_rope"])
def test_logits_match_transformers_on_cuda(tmp_path, name):
    """The whole engine on a GPU (torch_sdpa backend, float32 KV cache on the
    device) against transformers in float64 on the CPU, every step."""
    model_dir = tmp_path / name
    CHECKPOINTS[name](model_dir)
    llm, outputs, recorder = run_recorded(model_dir, _prompts(), MAX_TOKENS, max_num_seqs=3, device="cuda")
    runner = llm.llm_engine.model_runner
    assert runner.device.type == "cuda"
    assert all(c.device.type == "cuda" for c in runner.kv_caches)
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(MAX_TOKENS)
    assert_matches_hf(model_dir, outputs, recorder)


def test_tied_checkpoint_has_no_lm_head_tensor(tmp_path):
    # Otherwise the tied case above would not test tying.
    from checkpoints import checkpoint_tensor_names

    write_tiny_llama(tmp_path, tie_word_embeddings=True)
    assert read_config(tmp_path)["tie_word_embeddings"] is True
    assert not [n for n in checkpoint_tensor_names(tmp_path) if n.startswith("lm_head")]


def test_llama3_rope_scaling_changes_the_reference(tmp_path):
    # Otherwise a model that ignored rope_scaling would pass the llama3 case above.
    plain, scaled = write_tiny_llama(tmp_path / "plain", rope_theta=500000.0), write_tiny_llama(
        tmp_path / "scaled", rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    ids = _prompts()[3]["prompt_token_ids"]
    with torch.no_grad():
        a = load_hf_model(plain)(input_ids=torch.tensor([ids])).logits[0]
        b = load_hf_model(scaled)(input_ids=torch.tensor([ids])).logits[0]
    assert (a - b).abs().max() > 100 * ATOL


# ---------------------------------------------------------------------------------- preemption
def test_preempted_sequences_resume_with_the_same_logits(tmp_path):
    model_dir = write_tiny_llama(tmp_path)
    # 2 kv heads x 16 dims x 2 layers x K/V x 16 tokens x 4 bytes = 8 KiB per block. Six blocks
    # hold one 64-token request (4 blocks) but not four prompts that each grow to ~50 tokens.
    block_bytes = 2 * 16 * 2 * 2 * 16 * 4
    lengths, max_tokens = (5, 9, 12, 7), (40, 38, 36, 42)
    g = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in lengths]
    # The requests ignore EOS, so the scheduler would reserve their whole budgets and run them without a
    # preemption; admitting on the watermark alone (vLLM's policy) overfills the cache.
    llm, outputs, recorder = run_recorded(model_dir, prompts, max_tokens, reserve_growth=False,
                                          kv_cache_memory=6 * block_bytes, block_size=16, max_model_len=64)
    engine = llm.llm_engine
    assert engine.model_runner.num_blocks == 6
    assert engine.scheduler.num_preemptions > 0
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(max_tokens)
    preempted = [o.request_id for o in outputs
                 if any(s.num_preemptions for s in recorder.steps[o.request_id].values())]
    assert preempted
    for out in outputs:
        if out.request_id in preempted:
            # The resumed prefill recomputed prompt + output so far, and decoding went on after it.
            resumed = [n for n, s in recorder.steps[out.request_id].items() if s.is_prefill and s.num_preemptions]
            first, last = len(out.prompt_token_ids), len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
            assert resumed and first < min(resumed) < last
    assert_matches_hf(model_dir, outputs, recorder, exact_greedy_ids=tuple(preempted))
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 6


# ---------------------------------------------------------------------------- batch invariance
def assert_batch_invariant(model_dir, prompts, max_tokens: int, **llm_kwargs) -> None:
    """assert_greedy_batch_invariant on a float32 LLM of `model_dir` (with `llm_kwargs`)."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, **llm_kwargs)
    assert_greedy_batch_invariant(llm, prompts, max_tokens)


def test_greedy_tokens_do_not_depend_on_the_batch(tmp_path):
    model_dir = write_tiny_llama(tmp_path)
    assert_batch_invariant(model_dir, _prompts(seed=3), max_tokens=24)


# ------------------------------------------------------------------ the real default model
@pytest.fixture(scope="module")
def default_model_dir():
    return ensure_default_model()


def test_default_model_logits_match_transformers(default_model_dir):
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=256)
    assert llm.llm_engine.config.model_config.model == str(default_model_dir)
    recorder = LogitsRecorder(llm)
    text = "Gravity is the force by which a planet or other body draws objects toward its center, and it"
    prompt_ids = llm.get_tokenizer().encode(text)
    assert 18 <= len(prompt_ids) <= 24
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 6  # the prefill and 5 decode steps
    assert_matches_hf(default_model_dir, outputs, recorder)


def test_default_model_bf16_long_prefill_on_amx_matches_transformers(default_model_dir, monkeypatch):
    """A bf16 prefill long enough for the AMX attention kernel: its last-position logits are as close
    to transformers' float64 ones as those of the same engine with torch's SDPA (bf16 throughout)."""
    from fp8serve.kernels import prefill_attention_ops

    if not prefill_attention_ops.amx_available():
        pytest.skip("no AMX tiles in this build or process")
    llm = LLM(dtype="bfloat16", kv_cache_memory=64 << 20, max_model_len=512)
    recorder = LogitsRecorder(llm)
    text = " ".join(f"Step {i}: the force of gravity pulls every object toward the center of the planet."
                    for i in range(12))
    prompt_ids = llm.get_tokenizer().encode(text)
    assert len(prompt_ids) >= 200  # several 32-key blocks for most query blocks
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    calls = []
    real = prefill_attention_ops.prefill_attention
    monkeypatch.setattr(prefill_attention_ops, "prefill_attention",
                        lambda q, *a, **k: calls.append(q.dtype) or real(q, *a, **k))
    amx_out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    assert calls and set(calls) == {torch.bfloat16}, "the bf16 prefill did not run the AMX kernel"
    monkeypatch.setattr(prefill_attention_ops, "MIN_MEAN_PROMPT_TOKENS_AMX", 1 << 30)  # torch's SDPA instead
    calls.clear()
    sdpa_out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    assert not calls
    n = len(prompt_ids)
    amx_logits = recorder.steps[amx_out.request_id][n].logits.double()
    sdpa_logits = recorder.steps[sdpa_out.request_id][n].logits.double()
    with torch.no_grad():
        ref = load_hf_model(default_model_dir, torch.float64)(input_ids=torch.tensor([prompt_ids])).logits[0, -1]
    err_amx, err_sdpa = (amx_logits - ref).abs().max().item(), (sdpa_logits - ref).abs().max().item()
    # bf16 weights and activations dominate both errors; P rounded to bf16 adds to the
    # kernel's: measured 0.31 (AMX) against 0.21 (SDPA) on this 218-token prompt.
    assert err_amx <= 1.5 * err_sdpa + 0.05, f"AMX {err_amx:.3f} vs SDPA {err_sdpa:.3f} (max |dlogit| to float64)"
    token = amx_out.outputs[0].token_ids[0]
    assert token == int(ref.argmax()) or ref.max() - ref[token] <= 2 * err_amx, "not a greedy token within the error"
