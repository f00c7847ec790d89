"""The element kernels against plain torch: the fused scale-and-cast must round exactly as torch's
own conversion does (round to nearest even, once), and the reduction must sum the sources in
order in float32, bit for bit, with every instruction set this CPU has, through the cache or
with streaming stores, from any output alignment."""

import pytest
import torch

from ddpx._ext import extension

C = extension()


def _available_isas() -> list[str]:
    found = []
    for isa in ("portable", "avx2"):
        try:
            C.kernel_convert(torch.zeros(1), torch.zeros(1), 1.0, isa)
            found.append(isa)
        except RuntimeError:
            pass
    return found


ISAS = _available_isas()

HALF_AND_FLOAT = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 7, 8, 9, 31, 32, 33, 255, 256, 257, 1000, 4099]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, with every NaN made the same so NaN payloads do not count."""
    t = t.clone()
    nan = t.isnan()
    t[nan] = float("nan")
    view = {4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]
    out = t.view(view).clone()
    out[nan] = 0
    return out, nan


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor):
    a, a_nan = bits(actual)
    e, e_nan = bits(expected)
    assert torch.equal(a_nan, e_nan)
    mismatch = (a != e).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} elements differ, first at {mismatch[0].item()}: "
        f"{actual.flatten()[mismatch[0]].item()} vs {expected.flatten()[mismatch[0]].item()}")


def special_values(n: int) -> torch.Tensor:
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"),
                             65504.0, 65519.0, 65520.0, 70000.0, 1e-8, 6e-8, 3e-5, 1e-40,
                             3.0e38, 1.00390625, 1.0078125, 2049.0, 2050.0, 2051.0])
    values = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 100
    values[: min(n, len(specials))] = specials[: min(n, len(specials))]
    return values


def test_kernels_chosen_for_this_cpu():
    assert C.kernel_isa() in ISAS
    assert "portable" in ISAS


def output(n: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """An output tensor starting `offset` elements past an allocation's (aligned) start."""
    return torch.empty(n + offset, dtype=dtype)[offset:]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("src_dtype", HALF_AND_FLOAT)
@pytest.mark.parametrize("dst_dtype", HALF_AND_FLOAT)
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
@pytest.mark.parametrize("stream", [False, True])
def test_convert_rounds_like_torch(isa, src_dtype, dst_dtype, scale, stream):
    for n in SIZES:
        src = special_values(n).to(src_dtype)
        dst = output(n, dst_dtype, offset=n % 5)
        C.kernel_convert(dst, src, scale, isa, stream)
        assert_same_bits(dst, (src.float() * scale).to(dst_dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_to_half_on_many_bit_patterns(isa, dtype):
    patterns = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int64,
                             generator=torch.Generator().manual_seed(0)).to(torch.int32)
    src = patterns.view(torch.float32)
    dst = torch.empty(src.numel(), dtype=dtype)
    C.kernel_convert(dst, src, 1.0, isa)
    assert_same_bits(dst, src.to(dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_half_widens_exactly(isa, dtype):
    src = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    dst = torch.empty(src.numel(), dtype=torch.float32)
    C.kernel_convert(dst, src, 1.0, isa)
    assert_same_bits(dst, src.float())


def reference_sum(srcs, dst_dtype):
    acc = srcs[0].float()
    for s in srcs[1:]:
        acc = acc + s.float()
    return acc.to(dst_dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("src_dtype", HALF_AND_FLOAT)
@pytest.mark.parametrize("dst_dtype", HALF_AND_FLOAT)
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("stream", [False, True])
def test_reduce_sums_in_order_in_float32(isa, src_dtype, dst_dtype, nsrc, stream):
    for n in SIZES:
        srcs = [special_values(n).roll(k).to(src_dtype) * (k + 1) for k in range(nsrc)]
        dst = output(n, dst_dtype, offset=n % 5)
        C.kernel_reduce(dst, srcs, isa, stream)
        assert_same_bits(dst, reference_sum(srcs, dst_dtype))


@pytest.mark.parametrize("isa", ISAS)
def test_float64_sums_in_float64(isa):
    srcs = [torch.randn(1001, dtype=torch.float64) for _ in range(3)]
    dst = torch.empty(1001, dtype=torch.float64)
    C.kernel_reduce(dst, srcs, isa)
    assert_same_bits(dst, srcs[0] + srcs[1] + srcs[2])
    C.kernel_convert(dst, srcs[0], 1 / 3, isa)
    assert_same_bits(dst, srcs[0] * (1 / 3))


def test_reduce_in_place_on_first_source():
    srcs = [torch.randn(777) for _ in range(4)]
    expected = reference_sum(srcs, torch.float32)
    C.kernel_reduce(srcs[0], srcs, C.kernel_isa())
    assert_same_bits(srcs[0], expected)


def test_float64_cannot_mix_with_other_dtypes():
    with pytest.raises(ValueError, match="float64"):
        C.kernel_convert(torch.empty(4), torch.empty(4, dtype=torch.float64), 1.0, "portable")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("stream", [False, True])
def test_copy_moves_every_bit_pattern_at_any_alignment(isa, stream):
    """The all-gather's and broadcast's copy: any bytes (signalling NaN patterns included), every
    head and tail around the 32-byte stores, equal to the source bit for bit."""
    bits = torch.Generator().manual_seed(0)
    src_all = torch.randint(0, 256, (70_000,), dtype=torch.uint8, generator=bits)
    for offset in (0, 1, 7, 31, 33):
        for n in (0, 1, 31, 255, 256, 257, 4096 + 13, 65_536 + 5):
            src = src_all[offset:offset + n]
            dst_all = torch.zeros(n + 64, dtype=torch.uint8)
            dst = dst_all[(offset * 3) % 32:][:n]
            C.kernel_copy(dst, src, isa, stream)
            assert torch.equal(dst, src), (offset, n)
