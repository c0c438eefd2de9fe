"""fp8serve.utils.huge_pages: the env switches, `pack_parameters_on_huge_pages` and the
`HugePageArena` both it and the packed weight copies use.

Packing moves every CPU parameter of at least `min_bytes` into one
2 MiB-aligned, MADV_HUGEPAGE-advised buffer per dtype. Values, identities
and tying must survive; small, non-contiguous parameters stay where they
are. Where the kernel refuses madvise (no transparent huge pages, a
container without it) the function moves nothing and returns 0; the
placement checks then skip with a reason.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from fp8serve.utils import huge_pages
from fp8serve.utils.huge_pages import advise_huge_pages, huge_pages_enabled, pack_parameters_on_huge_pages

ENV_VARS = ("FP8SERVE_HUGE_PAGES", "FP8SERVE_KV_HUGE_PAGES", "FP8SERVE_WEIGHT_HUGE_PAGES")
MIN_BYTES = 64 * 1024
MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


class TiedModel(nn.Module):
    """Parameters by dtype (each dtype group above one huge page, so that
    packing is not refused for size): float32 embedding tied to the LM
    head, a float32 matrix whose size is not a multiple of 64 bytes (the
    next one must still start 64-byte aligned), two bf16 matrices, a float16
    vector, plus parameters that must not move: small ones (below
    min_bytes) and a non-contiguous one."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()

        def p(*shape, dtype=torch.float32):
            return nn.Parameter((torch.randn(*shape, generator=g) * 3).to(dtype), requires_grad=False)

        self.embed = p(4096, 96)  # 1.5 MiB
        self.lm_head = nn.Module()
        self.lm_head.weight = self.embed  # tied
        self.odd = p(1027, 131)  # 538 148 bytes: not a multiple of 64
        self.after_odd = p(300, 100)
        self.w_bf16 = p(1100, 1001, dtype=torch.bfloat16)  # ~2.1 MiB
        self.w_bf16_b = p(77, 555, dtype=torch.bfloat16)
        self.w_f16 = p(2 * MIB // 2 + 33, dtype=torch.float16)
        self.small = p(10)  # 40 bytes
        self.small_bf16 = p(3, 7, dtype=torch.bfloat16)
        self.transposed = nn.Parameter((torch.randn(256, 512, generator=g)).t(), requires_grad=False)

    def movable(self) -> list[nn.Parameter]:
        return [self.embed, self.odd, self.after_odd, self.w_bf16, self.w_bf16_b, self.w_f16]

    def fixed(self) -> list[nn.Parameter]:
        return [self.small, self.small_bf16, self.transposed]


def nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def snapshot(model: nn.Module):
    return {name: (p, p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters(remove_duplicate=False)}


# ----------------------------------------------------------------- switches


@pytest.mark.parametrize(
    "env,kv,weight",
    [
        ({}, True, True),
        ({"FP8SERVE_HUGE_PAGES": "1"}, True, True),
        ({"FP8SERVE_HUGE_PAGES": "0"}, False, False),
        ({"FP8SERVE_KV_HUGE_PAGES": "0"}, False, True),
        ({"FP8SERVE_WEIGHT_HUGE_PAGES": "0"}, True, False),
        ({"FP8SERVE_KV_HUGE_PAGES": "0", "FP8SERVE_WEIGHT_HUGE_PAGES": "0"}, False, False),
        ({"FP8SERVE_KV_HUGE_PAGES": "1", "FP8SERVE_WEIGHT_HUGE_PAGES": "1"}, True, True),
        # The global switch wins over the per-kind ones.
        ({"FP8SERVE_HUGE_PAGES": "0", "FP8SERVE_KV_HUGE_PAGES": "1", "FP8SERVE_WEIGHT_HUGE_PAGES": "1"}, False, False),
        ({"FP8SERVE_HUGE_PAGES": "1", "FP8SERVE_KV_HUGE_PAGES": "0"}, False, True),
        ({"FP8SERVE_HUGE_PAGES": "1", "FP8SERVE_WEIGHT_HUGE_PAGES": "0"}, True, False),
    ],
)
def test_huge_pages_enabled_truth_table(monkeypatch, env, kv, weight):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert huge_pages_enabled("kv") is kv
    assert huge_pages_enabled("weight") is weight


def test_advise_respects_switches(monkeypatch):
    t = torch.empty(3 * MIB, dtype=torch.uint8)
    monkeypatch.setenv("FP8SERVE_KV_HUGE_PAGES", "0")
    assert advise_huge_pages(t, "kv") is False
    monkeypatch.setenv("FP8SERVE_HUGE_PAGES", "0")
    assert advise_huge_pages(t, "weight") is False
    # Smaller than one aligned huge page: nothing to advise.
    monkeypatch.delenv("FP8SERVE_KV_HUGE_PAGES")
    monkeypatch.delenv("FP8SERVE_HUGE_PAGES")
    assert advise_huge_pages(torch.empty(4096, dtype=torch.uint8), "kv") is False


# ------------------------------------------------------------------ packing


def test_pack_moves_large_parameters(seed):
    model = TiedModel(torch.Generator().manual_seed(seed))
    before = snapshot(model)
    expected = sum(nbytes(p) for p in model.movable())
    moved = pack_parameters_on_huge_pages(model, min_bytes=MIN_BYTES)
    if moved == 0:
        pytest.skip("madvise(MADV_HUGEPAGE) refused here (no transparent huge pages?): nothing moved")
    ctx = f"seed={seed}"
    assert moved == expected, f"{ctx}: moved {moved} bytes, expected {expected} (tied weight counted once)"

    for name, (param, ptr, value) in before.items():
        now = dict(model.named_parameters(remove_duplicate=False))[name]
        assert now is param, f"{name}: the Parameter object was replaced"
        assert torch.equal(now.detach(), value), f"{ctx}: {name} changed value"
        assert now.dtype == value.dtype and now.shape == value.shape and not now.requires_grad
    # Tied parameters are still one Parameter, on one storage.
    assert model.lm_head.weight is model.embed
    assert model.lm_head.weight.data_ptr() == model.embed.data_ptr()

    for p in model.movable():
        assert p.is_contiguous()
        assert p.data_ptr() % 64 == 0, f"a moved {p.dtype} parameter {tuple(p.shape)} is not 64-byte aligned"
    old_ptrs = {id(p): before_ptr for _, (p, before_ptr, _) in before.items()}
    for p in model.movable():
        assert p.data_ptr() != old_ptrs[id(p)], f"{p.dtype} {tuple(p.shape)} was not moved"
    for p in model.fixed():
        assert p.data_ptr() == old_ptrs[id(p)], f"{p.dtype} {tuple(p.shape)} should not have moved"

    # One buffer per dtype, starting on a huge-page boundary, no overlaps.
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in model.movable():
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, params in by_dtype.items():
        bases = {p.untyped_storage().data_ptr() for p in params}
        assert len(bases) == 1, f"{dtype}: parameters in {len(bases)} buffers"
        spans = sorted((p.data_ptr(), p.data_ptr() + nbytes(p)) for p in params)
        assert spans[0][0] % (2 * MIB) == 0, f"{dtype}: buffer not 2 MiB aligned"
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, f"{dtype}: parameters overlap"

    # The model still computes the same thing, and a second pack is harmless.
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(x @ model.embed.t(), x @ before["embed"][2].t())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pack_parameters_on_huge_pages(model, min_bytes=MIN_BYTES)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} changed on a second pack"


@pytest.mark.parametrize("switch", ["FP8SERVE_HUGE_PAGES", "FP8SERVE_WEIGHT_HUGE_PAGES"])
def test_pack_disabled_moves_nothing(monkeypatch, seed, switch):
    monkeypatch.setenv(switch, "0")
    model = TiedModel(torch.Generator().manual_seed(seed))
    before = snapshot(model)
    assert pack_parameters_on_huge_pages(model, min_bytes=MIN_BYTES) == 0
    for name, (param, ptr, value) in before.items():
        assert param.data_ptr() == ptr, f"{switch}=0 but {name} moved"
        assert torch.equal(param.detach(), value)


def test_pack_kv_switch_does_not_affect_weights(monkeypatch, seed):
    monkeypatch.setenv("FP8SERVE_KV_HUGE_PAGES", "0")
    model = TiedModel(torch.Generator().manual_seed(seed))
    moved = pack_parameters_on_huge_pages(model, min_bytes=MIN_BYTES)
    if moved == 0:
        pytest.skip("madvise(MADV_HUGEPAGE) refused here: nothing moved")
    assert moved == sum(nbytes(p) for p in model.movable())


def test_pack_refused_madvise_moves_nothing(monkeypatch, seed):
    """A refused madvise leaves every parameter where it was (and returns 0)."""
    monkeypatch.setattr(huge_pages, "advise_huge_pages", lambda t, kind="kv": False)
    model = TiedModel(torch.Generator().manual_seed(seed))
    before = snapshot(model)
    assert pack_parameters_on_huge_pages(model, min_bytes=MIN_BYTES) == 0
    for name, (param, ptr, value) in before.items():
        assert param.data_ptr() == ptr and torch.equal(param.detach(), value), name


def test_pack_min_bytes_threshold(seed):
    """Everything below min_bytes stays put: with a huge threshold nothing moves."""
    model = TiedModel(torch.Generator().manual_seed(seed))
    before = snapshot(model)
    assert pack_parameters_on_huge_pages(model, min_bytes=64 * MIB) == 0
    for name, (param, ptr, _) in before.items():
        assert param.data_ptr() == ptr, name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are Linux only")
def test_pack_small_dtype_group_does_not_block_others():
    g = torch.Generator().manual_seed(0)
    model = nn.Module()
    model.small_f32 = nn.Parameter(torch.randn(256, 256, generator=g), requires_grad=False)  # 256 KiB, first
    model.big_bf16 = nn.Parameter(torch.randn(1100, 1001, generator=g).bfloat16(), requires_grad=False)
    probe = nn.Module()
    probe.w = nn.Parameter(torch.randn(1100, 1001, generator=g).bfloat16(), requires_grad=False)
    if pack_parameters_on_huge_pages(probe, min_bytes=MIN_BYTES) == 0:
        pytest.skip("madvise(MADV_HUGEPAGE) refused here")
    moved = pack_parameters_on_huge_pages(model, min_bytes=MIN_BYTES)
    assert moved == nbytes(model.small_f32) + nbytes(model.big_bf16)


# ------------------------------------------------------------------ arena


def test_arena_hands_out_aligned_tensors_in_order():
    sizes = [(3, 5), (64,), (7, 3, 2)]
    dtypes = [torch.bfloat16, torch.uint8, torch.float32]
    nbytes = [15 * 2, 64, 42 * 4]
    assert [huge_pages.HugePageArena.span(n) for n in nbytes] == [64, 64, 192]
    arena = huge_pages.HugePageArena.allocate(sum(huge_pages.HugePageArena.span(n) for n in nbytes))
    if arena is None:
        pytest.skip("madvise(MADV_HUGEPAGE) refused here (no transparent huge pages?): no arena")
    out = [arena.empty(s, d) for s, d in zip(sizes, dtypes)]
    assert out[0].data_ptr() % (2 * MIB) == 0, "the arena does not start on a 2 MiB boundary"
    for t, s, d in zip(out, sizes, dtypes):
        assert t.shape == s and t.dtype == d and t.is_contiguous() and t.data_ptr() % 64 == 0
    assert [b.data_ptr() - a.data_ptr() for a, b in zip(out, out[1:])] == [64, 64]  # in order, packed
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
    for i, t in enumerate(out):
        t.fill_(i + 1)
    assert [int(t.float().min()) for t in out] == [1, 2, 3] == [int(t.float().max()) for t in out]
    with pytest.raises(RuntimeError, match="HugePageArena: 1 bytes asked with 0 of"):
        arena.empty((1,), torch.uint8)


def test_arena_not_made_when_off_or_empty(monkeypatch):
    assert huge_pages.HugePageArena.allocate(0) is None
    if huge_pages.HugePageArena.allocate(4096) is None:
        pytest.skip("madvise(MADV_HUGEPAGE) refused here: no arena to switch off")
    monkeypatch.setenv("FP8SERVE_WEIGHT_HUGE_PAGES", "0")
    assert huge_pages.HugePageArena.allocate(4096) is None
    assert huge_pages.HugePageArena.allocate(4096, "kv") is not None  # the KV switch is another one
