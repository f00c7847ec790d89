"""The GPU path. Every .cu file compiles with this machine's nvcc, GPU or not, so a CUDA compile
error fails CI anywhere. The kernels round and sum exactly as plain torch does, and stay within
their rounding bounds of a float64 reference; their tests share one body with the CPU kernels of
the same contract, so the bodies run without a GPU too. On a GPU (tools/gpu_check.sh runs this
file there) the kernels also run past 2^31 elements and on a side stream, and the fused hook and
ddpx.all_reduce reduce CUDA tensors over NCCL on 1 GPU (on 2 if there are), and over gloo with 2
and 3 ranks sharing one GPU, which NCCL refuses: every multi-rank step of the CUDA engine but
NCCL's own collectives between ranks. DDP's options, bf16/fp16 buckets (over a wire of the other
16-bit type too) and backward on a side stream run on the CPU's engine here and on the GPU's there,
with one body; so does the engine's own group for a timeout other than its group's."""

import copy
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

from ddpx._buildspec import CUDA_SOURCES
from ddpx._ext import extension

from distributed import run_ranks

C = extension()
ROOT = Path(__file__).resolve().parents[1]
CU_FILES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
# The process groups the engine is tried on: NCCL with one rank per GPU, gloo with every rank on
# cuda:0 (it carries CUDA tensors through host memory, so ranks may share a GPU).
NCCL_1 = pytest.param("nccl", 1, marks=needs_gpu, id="nccl-1")
NCCL_2 = pytest.param("nccl", 2, marks=needs_two_gpus, id="nccl-2")
GLOO_2 = pytest.param("gloo", 2, marks=needs_gpu, id="gloo-2-on-one-gpu")
GLOO_3 = pytest.param("gloo", 3, marks=needs_gpu, id="gloo-3-on-one-gpu")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 7, 8, 9, 1023, 4097, 1_000_003]
# On a GPU also a size whose vector loop strides past the kernels' bounded grid
# (1024 blocks x 256 threads x 8 elements).
GPU_SIZES = [*SIZES, 4_194_311]


def _nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc on PATH or in /usr/local/cuda/bin")
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cuda_source_compiles(source, tmp_path):
    assert f"cuda/{source.name}" in CUDA_SOURCES, f"setup.py would not build {source.name}"
    # torch's own nvcc flags switch off the implicit half/bfloat16 conversions: build as it does.
    command = [_nvcc(), *COMMON_NVCC_FLAGS, "-std=c++17", "-arch=sm_90", "-c", str(source),
               "-o", str(tmp_path / "out.o")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr}"


def _cuda_include() -> Path | None:
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    return None


GLUE = [ROOT / "csrc" / name for name in CUDA_SOURCES if name.endswith(".cpp")]


@pytest.mark.skipif(_cuda_include() is None or shutil.which("c++") is None,
                    reason="no CUDA headers in CUDA_HOME or /usr/local/cuda, or no c++")
@pytest.mark.parametrize("source", GLUE, ids=lambda p: p.name)
def test_cuda_glue_has_no_compile_errors_of_its_own(source, tmp_path):
    """The torch glue (cuda_engine.cpp) builds only against a CUDA torch. A CPU torch ships the
    same headers but not those of the CUDA libraries (cusparse.h, ...) nor a generated
    cuda_cmake_macros.h: with empty stand-ins for them, the compiler still parses every line of
    ddpx's sources. Errors in torch's headers (types the stand-ins lack) do not count; any in
    ddpx's own files fail the test."""
    stubs = tmp_path / "stubs"
    command = ["c++", "-std=c++20", "-fsyntax-only", "-fmax-errors=1000", "-DDDPX_WITH_CUDA",
               "-DTORCH_EXTENSION_NAME=_C", *(f"-I{p}" for p in cpp_extension.include_paths()),
               f"-I{_cuda_include()}", f"-I{sysconfig.get_paths()['include']}", f"-I{stubs}",
               str(source)]
    for _ in range(20):
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        missing = re.search(r"fatal error: ([\w./]+): No such file", result.stderr)
        if missing is None:
            break
        stub = stubs / missing.group(1)
        assert not stub.exists(), result.stderr
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.touch()
    ours = [line for line in result.stderr.splitlines()
            if re.match(rf"{re.escape(str(ROOT / 'csrc'))}/\S+:\d+:\d+: error", line)]
    assert not ours, "\n".join(ours)
    assert "fatal error" not in result.stderr, result.stderr


def _scale_cast(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    if dst.is_cuda:
        C.cuda_scale_cast(dst, src, scale)
    else:
        C.kernel_convert(dst, src, scale, C.kernel_isa())


def _sum_slices(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.is_cuda:
        C.cuda_sum_slices(dst, src)
    else:
        C.kernel_reduce(dst, list(src.unbind(0)), C.kernel_isa())


def _reference_sum(slices: torch.Tensor) -> torch.Tensor:
    total = slices[0].float()
    for row in slices[1:]:
        total = total + row.float()
    return total.to(slices.dtype)


def _values(n: int, seed: int = 0) -> torch.Tensor:
    """Random values with the edge cases first: infinities, NaN, signed zeros, fp16 overflow
    before and after scaling, denormals, and ties of the bf16/fp16 rounding."""
    specials = torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 65504.0,
                             65520.0, 70000.0, 1e-40, 6e-8, 3e38, 1.00390625, 2049.0, 2051.0])
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed + n)) * 100
    values[: min(n, len(specials))] = specials[: min(n, len(specials))]
    return values


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit (any NaN matches any NaN), compared where `actual` is."""
    expected = expected.to(actual.device)
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN in different places"
    view = {4: torch.int32, 2: torch.int16}[expected.element_size()]
    differ = (actual.view(view) != expected.view(view)) & ~nan
    count = int(differ.sum())
    if count:
        first = int(differ.to(torch.uint8).argmax())  # nonzero() would list every difference
        raise AssertionError(f"{count} of {expected.numel()} elements differ, first at {first}: "
                             f"{actual[first].item()} vs {expected[first].item()}")


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _half_subnormal_step(dtype: torch.dtype) -> float:
    """The largest error of a rounding to `dtype` whose result is subnormal."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def _assert_within(actual: torch.Tensor, exact: torch.Tensor, bound, where=None) -> None:
    """|actual - exact| <= bound (a number or one per element) wherever `where` holds (default:
    everywhere); exact is float64. A NaN or an infinity where exact is finite fails."""
    actual = actual.cpu().double()
    exact = exact.cpu()
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(exact)
    where = torch.ones_like(exact, dtype=torch.bool) if where is None else where.cpu()
    bad = where & ~((actual - exact).abs() <= bound)
    if bad.any():
        i = int(bad.to(torch.uint8).argmax())
        raise AssertionError(
            f"{int(bad.sum())} of {int(where.sum())} elements beyond the bound, first at {i}: "
            f"{actual[i].item()!r} vs exact {exact[i].item()!r}, |diff| "
            f"{abs(actual[i] - exact[i]).item():.3g} > {bound[i].item():.3g}")


def _unaligned(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.empty(n + 1, dtype=dtype, device=device)[1:]


@pytest.fixture
def kernels_on(request):
    device = request.param
    if device == "cuda":
        assert C.has_cuda_kernels, ("ddpx._C was built without its CUDA kernels on a machine with "
                                    "a GPU: build it with a CUDA torch and a CUDA toolkit")
    return device


def _assert_scaled_within_float64(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """dst = src * scale within the three roundings the kernel makes: of the scale and of the
    product to float32, then of the product to dst's dtype, each at most its unit roundoff
    relative, or half a subnormal step absolute where the result is subnormal. Overflow and NaN
    are left to the bit-for-bit check."""
    exact = src.double() * scale
    in_range = exact.abs() <= torch.finfo(dst.dtype).max
    u, u32 = _unit_roundoff(dst.dtype), _unit_roundoff(torch.float32)
    torch.testing.assert_close(
        dst.cpu().double()[in_range], exact[in_range], rtol=(1 + u) * (1 + u32) ** 2 - 1,
        atol=_half_subnormal_step(dst.dtype) + (1 + u) * _half_subnormal_step(torch.float32))


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_scale_cast_rounds_like_torch(kernels_on, src_dtype, dst_dtype):
    for n in GPU_SIZES if kernels_on == "cuda" else SIZES:
        src = _values(n).to(src_dtype)
        for scale in (1.0, 1 / 3):
            expected = (src.float() * scale).to(dst_dtype)
            dst = torch.empty(n, dtype=dst_dtype, device=kernels_on)
            _scale_cast(dst, src.to(kernels_on), scale)
            _assert_same_bits(dst, expected)
            _assert_scaled_within_float64(dst, src, scale)
        # Unaligned pointers take the scalar path.
        dst, moved = _unaligned(n, dst_dtype, kernels_on), _unaligned(n, src_dtype, kernels_on)
        moved.copy_(src)
        _scale_cast(dst, moved, 0.25)
        _assert_same_bits(dst, (src.float() * 0.25).to(dst_dtype))


def _assert_sum_within_float64(dst: torch.Tensor, rows: torch.Tensor) -> None:
    """dst = the sum of the rows within what summing k slices in float32 and rounding once
    allows: k - 1 float32 additions, each off by at most u32 of the sum of the magnitudes (or half
    a float32 subnormal step), then one rounding of that sum to dst's dtype (u of it, or half a
    subnormal step of dst's dtype). Sums beyond dst's range are left to the bit-for-bit check."""
    wide = rows.double()
    exact, magnitude = wide.sum(0), wide.abs().sum(0)
    u, u32 = _unit_roundoff(dst.dtype), _unit_roundoff(torch.float32)
    float32_error = (rows.shape[0] - 1) * (u32 * magnitude + _half_subnormal_step(torch.float32))
    bound = u * exact.abs() + (1 + u) * float32_error + _half_subnormal_step(dst.dtype)
    _assert_within(dst, exact, bound, where=exact.abs() < torch.finfo(dst.dtype).max)


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("nslices", [1, 2, 3, 8])
def test_sum_slices_in_order_in_float32(kernels_on, dtype, nslices):
    for n in GPU_SIZES if kernels_on == "cuda" else SIZES:
        rows = torch.stack([_values(n, seed=s) for s in range(nslices)]).to(dtype)
        expected = _reference_sum(rows)
        # Rows padded to whole 16-byte packs as the engine lays them out, then packed tight,
        # which takes the scalar path when n is not a multiple of 8.
        for row in (n + 15) // 8 * 8, n:
            src = torch.zeros(nslices, row, dtype=dtype, device=kernels_on)[:, :n]
            src.copy_(rows)
            dst = torch.empty(n, dtype=dtype, device=kernels_on)
            _sum_slices(dst, src)
            _assert_same_bits(dst, expected)
        _assert_sum_within_float64(dst, rows)


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nan_and_inf_come_out_as_torch_gives_them(kernels_on, dtype):
    """Each pair of a NaN or an infinity with a number, with another infinity, or with a NaN, and
    the largest finite values, which overflow when summed or doubled: three times over, so that
    every pair goes through a 16-byte pack and some through the scalar tail (29 elements), then
    all through the scalar path (unaligned)."""
    inf, nan, big = float("inf"), float("nan"), torch.finfo(dtype).max
    pairs = [(inf, 1.0), (-inf, 1.0), (inf, inf), (inf, -inf), (nan, 1.0), (1.0, nan), (nan, inf),
             (big, big), (-big, -big), (big, -big)]
    rows = torch.tensor(pairs, dtype=torch.float64).T.to(dtype).repeat(1, 3)[:, :29].contiguous()
    expected_sum = _reference_sum(rows)
    for aligned in True, False:
        # Rows of whole 16-byte packs (32 elements), or shifted by one element.
        src = (torch.empty(2, 32, dtype=dtype, device=kernels_on)[:, :29] if aligned else
               torch.empty(2, 30, dtype=dtype, device=kernels_on)[:, 1:])
        src.copy_(rows)
        summed = torch.empty(29, dtype=dtype, device=kernels_on)
        _sum_slices(summed, src)
        _assert_same_bits(summed, expected_sum)
        for dst_dtype in FLOATS:
            for scale in (1.0, 2.0):
                cast = (torch.empty(29, dtype=dst_dtype, device=kernels_on) if aligned else
                        _unaligned(29, dst_dtype, kernels_on))
                _scale_cast(cast, src[0], scale)
                _assert_same_bits(cast, (rows[0].float() * scale).to(dst_dtype))


@needs_gpu
def test_kernels_past_2_to_the_31_elements():
    """2^31 + 11 elements: any 32-bit index or byte offset in the kernels wraps. The outputs start
    as NaN, so an element a kernel leaves unwritten fails the comparison. The references are
    torch's own CUDA conversions and float32 sums, compared on the GPU."""
    n = 2**31 + 11
    need = 24 * n  # bytes at the peak (the sum below: two bf16 slices, their float32 sum, ...)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory for {n} elements, "
                    f"{free / 2**30:.0f} GiB free")
    nan = float("nan")
    try:
        wide = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        narrow = torch.full((n,), nan, dtype=torch.bfloat16, device="cuda")
        C.cuda_scale_cast(narrow, wide, 1 / 3)  # vector packs, then a tail of 3
        _assert_same_bits(narrow, (wide * (1 / 3)).to(torch.bfloat16))
        del wide
        widened = torch.full((n,), nan, device="cuda")
        C.cuda_scale_cast(widened, narrow, 1.0)
        _assert_same_bits(widened, narrow.float())
        shifted = _unaligned(n, torch.bfloat16, "cuda")
        shifted.copy_(narrow)
        widened.fill_(nan)
        C.cuda_scale_cast(widened, shifted, 1.0)  # the scalar loop over every element
        _assert_same_bits(widened, narrow.float())
        del widened, shifted
        # Two slices laid out as the engine pads them (rows of whole packs), as one bf16 block.
        slices = torch.empty(2, (n + 7) // 8 * 8, dtype=torch.bfloat16, device="cuda")[:, :n]
        slices[0].copy_(narrow)
        slices[1].copy_((narrow.float() * -0.75).to(torch.bfloat16))
        del narrow
        summed = torch.full((n,), nan, dtype=torch.bfloat16, device="cuda")
        C.cuda_sum_slices(summed, slices)
        _assert_same_bits(summed, _reference_sum(slices))
    finally:
        torch.cuda.empty_cache()  # the ranks of the tests below share this GPU


# Cycles the GPU spins for on a side stream: about 0.1 s at the 1.5-2 GHz of current GPUs, long
# enough that a call that waits for the stream (or the device) returns only after it is idle.
SPIN_CYCLES = 200_000_000


@needs_gpu
def test_kernels_run_on_the_current_stream_without_waiting():
    """On a side stream that is still busy: each kernel reads its input only after the work queued
    before it there (the input starts as NaN on the default stream's side), and the call returns
    while the stream is busy: no wait for the stream, nor for the device. The results are read
    after that stream alone is synchronized."""
    n = 1_000_003
    values = _values(n).cuda()
    src = torch.full_like(values, float("nan"))
    narrow = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    rows = torch.empty(2, n, dtype=torch.bfloat16, device="cuda")
    summed = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    torch.cuda.current_stream().synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN_CYCLES)
        src.copy_(values)
        C.cuda_scale_cast(narrow, src, 0.5)
        rows.copy_(narrow.expand(2, n))
        C.cuda_sum_slices(summed, rows)
        busy = not side.query()
    side.synchronize()
    assert busy, "a kernel call returned only once its stream was idle: it waited for it"
    expected = (_values(n) * 0.5).to(torch.bfloat16)
    _assert_same_bits(narrow, expected)
    _assert_same_bits(summed, _reference_sum(torch.stack([expected, expected])))


def _gloo_refusal() -> str | None:
    """Why this gloo group cannot carry the CUDA engine's collectives, or None: asked of
    torch.distributed itself on small CUDA tensors of every dtype the tests send, before ddpx
    runs, so that a refusal skips the test and any later error is ddpx's."""
    import torch.distributed as dist

    world = dist.get_world_size()
    for dtype in FLOATS:
        part = torch.ones(8, dtype=dtype, device="cuda")
        whole = torch.ones(8 * world, dtype=dtype, device="cuda")
        for name, collective, args in (
                ("all_reduce", dist.all_reduce, (whole,)),
                ("all_to_all_single", dist.all_to_all_single, (torch.empty_like(whole), whole)),
                ("all_gather_into_tensor", dist.all_gather_into_tensor, (whole, part))):
            try:
                collective(*args)
            except (RuntimeError, ValueError, NotImplementedError) as error:
                return (f"gloo (torch {torch.__version__}) refuses {name} of a CUDA {dtype} "
                        f"tensor: {str(error).splitlines()[0]}")
    return None


def _unless_refused(run):
    """Runs run() on a rank; ("refused", why) where its group is gloo and cannot carry CUDA
    tensors, else ("ran", its result)."""
    import torch.distributed as dist

    refused = _gloo_refusal() if dist.get_backend() == "gloo" else None
    return ("refused", refused) if refused else ("ran", run())


def _results(by_rank: list) -> list:
    """The ranks' results, or a skip that names what the process group refused."""
    status, value = by_rank[0]
    if status == "refused":
        pytest.skip(value)
    return [value for _, value in by_rank]


ALL_REDUCE_CASES = [(n, dtype, compression) for n in (0, 1, 7, 4097, 1_000_003)
                    for dtype, compression in ((torch.float32, "bf16"), (torch.float32, "fp16"),
                                               (torch.bfloat16, None), (torch.float16, None),
                                               (torch.float32, None))]


def _gpu_all_reduce(rank, world):
    import ddpx

    def run():
        results = []
        for n, dtype, compression in ALL_REDUCE_CASES:
            tensor = _values(n, seed=rank).to(dtype).cuda()
            ddpx.all_reduce(tensor, average=True, compression=compression)
            results.append(tensor.cpu())
        return results

    return _unless_refused(run)


@pytest.mark.parametrize(("backend", "world"), [NCCL_1, NCCL_2, GLOO_2, GLOO_3])
def test_gpu_all_reduce_matches_reference(backend, world):
    by_rank = _results(run_ranks(_gpu_all_reduce, world, backend=backend, timeout=120))
    for case, (result, *others) in zip(ALL_REDUCE_CASES, zip(*by_rank, strict=True), strict=True):
        n, dtype, compression = case
        for other in others:
            _assert_same_bits(other, result)  # every rank gets the same bits
        inputs = [_values(n, seed=r).to(dtype) for r in range(world)]
        if compression is None and dtype == torch.float32:
            # Every rank's input times float32(1 / world), then summed by the group (NCCL's
            # premultiplied sum; gloo's sum after ddpx's multiplication).
            scaled = torch.stack([x * (1.0 / world) for x in inputs])
            if world <= 2:
                # One or two terms sum to the same bits in any order.
                _assert_same_bits(result, _reference_sum(scaled))
                continue
            # The group sums in its own order: each product and each of the world - 1 additions
            # off by at most u32 of the sum of the magnitudes, and the scale's own rounding.
            exact = torch.stack(inputs).double().sum(0) / world
            magnitude = torch.stack(inputs).double().abs().sum(0) / world
            u32 = _unit_roundoff(torch.float32)
            finite = exact.isfinite()
            torch.testing.assert_close(result.double()[~finite], exact[~finite], rtol=0, atol=0,
                                       equal_nan=True, msg=f"{case}")
            _assert_within(result, exact, (world + 2) * u32 * magnitude
                           + world * _half_subnormal_step(torch.float32), where=finite)
        else:
            # Each rank's input scaled and cast to the wire dtype, summed in rank order in
            # float32, rounded once, widened.
            wire = {"bf16": torch.bfloat16, "fp16": torch.float16, None: dtype}[compression]
            sent = torch.stack([(x.float() * (1.0 / world)).to(wire) for x in inputs])
            _assert_same_bits(result, _reference_sum(sent).to(dtype))


def _all_reduce_on_a_side_stream(rank, world):
    import ddpx

    n = 1_000_003
    # The engine and NCCL's communicator are made on first use, off the side stream.
    ddpx.all_reduce(torch.zeros(8, device="cuda"), compression="bf16")
    side = torch.cuda.Stream()
    results = []
    for dtype, compression in ((torch.float32, None), (torch.float32, "bf16"),
                               (torch.bfloat16, None)):
        values = _values(n, seed=rank).to(dtype).cuda()
        tensor = torch.full_like(values, float("nan"))
        torch.cuda.current_stream().synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN_CYCLES)
            tensor.copy_(values)
            ddpx.all_reduce(tensor, average=True, compression=compression)
            busy = not side.query()
        side.synchronize()
        results.append((busy, tensor.cpu()))
    return results


@needs_gpu
def test_all_reduce_on_a_side_stream_is_ordered_there_and_never_waits():
    """ddpx.all_reduce called on a busy side stream over NCCL: the engine's kernels and
    collectives start after the work queued before them there (the tensor is NaN until then),
    the host returns before the stream is idle, and the sum is there once that stream alone is
    synchronized. Uncompressed float32, float32 over a bf16 wire, and a bf16 tensor."""
    [results] = run_ranks(_all_reduce_on_a_side_stream, 1, backend="nccl", timeout=120)
    for (busy, result), (dtype, wire) in zip(results, ((torch.float32, torch.float32),
                                                       (torch.float32, torch.bfloat16),
                                                       (torch.bfloat16, torch.bfloat16)),
                                             strict=True):
        assert busy, f"ddpx.all_reduce of {dtype} over a {wire} wire waited for its stream"
        _assert_same_bits(result, _values(1_000_003).to(dtype).to(wire).to(dtype))


def _premultiplied_sums(rank, world):
    from ddpx.engine import engine_for

    engine = engine_for(None, "cuda")
    results = []
    for scale in (0.25, 1 / 3):
        tensor = _values(1_000_003).cuda()
        engine.run(tensor, scale, None, "the premultiplied-sum check")
        results.append(tensor.cpu())
    return engine.describe(), results


@needs_gpu
def test_nccl_premultiplied_sum_scales_like_torch():
    """The float32 path of more than one rank is NCCL's premultiplied sum with the options ddpx
    builds (csrc/engine/engine.cpp, scaled_allreduce); with one rank and a scale other than 1 NCCL
    applies it too, one float32 multiplication by float32(scale) per element: torch's bits."""
    [(describe, results)] = run_ranks(_premultiplied_sums, 1, backend="nccl", timeout=120)
    assert describe.startswith("ddpx CUDA engine (nccl): premultiplied-sum all-reduce"), describe
    for scale, result in zip((0.25, 1 / 3), results, strict=True):
        _assert_same_bits(result, _values(1_000_003) * scale)


HOOK_CASES = [(compression, python_hook) for compression in (None, "bf16", "fp16")
              for python_hook in (False, True)]


def _hook_case(compression, python_hook):
    """Two steps of one net wrapped three ways: DDP with ddpx's hook, DDP with its default
    all-reduce, and no DDP at all (this rank's own gradients); each step's gradients of each."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddpx

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1031, 301), torch.nn.ReLU(),
                              torch.nn.Linear(301, 7)).to(device)
    local = copy.deepcopy(net)
    reference = DistributedDataParallel(copy.deepcopy(net), device_ids=[device.index])
    # One bucket in the first step; DDP rebuilds them for the second: 2114, 301 and 310331 elements.
    model = DistributedDataParallel(net, device_ids=[device.index], bucket_cap_mb=0.001)
    if python_hook:
        state = ddpx.FusedHookState(compression=compression, device="cuda")
        model.register_comm_hook(state, ddpx.fused_allreduce_hook)
    else:
        state = ddpx.register_fused_hook(model, compression=compression)
    x = torch.randn(16, 1031, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    steps = []
    for _ in range(2):
        for module in (model, reference, local):
            module.zero_grad(set_to_none=True)
            module(x).square().sum().backward()
        steps.append({name: [p.grad.cpu() for p in module.parameters()]
                      for name, module in (("ddpx", model), ("default", reference),
                                           ("local", local))})
    return state.describe(), steps


def _hook_steps(rank, world):
    return _unless_refused(lambda: {case: _hook_case(*case) for case in HOOK_CASES})


def _launched_once(fn, timeout: float):
    """run(backend, world, *args): fn's results by rank, from one launch of the ranks per
    process group and arguments (a failed launch fails every case that needs it, without a
    relaunch)."""
    runs = {}

    def run(backend, world, *args):
        key = backend, world, *args
        if key not in runs:
            try:
                runs[key] = run_ranks(fn, world, *args, backend=backend, timeout=timeout)
            except AssertionError as error:
                runs[key] = error
        if isinstance(runs[key], AssertionError):
            pytest.fail(f"the ranks failed:\n{runs[key]}")
        return _results(runs[key])

    return run


@pytest.fixture(scope="module")
def hook_runs():
    """run(backend, world): every hook case's results by rank."""
    return _launched_once(_hook_steps, timeout=120)


@pytest.mark.parametrize(("backend", "world"), [NCCL_1, NCCL_2, GLOO_2])
@pytest.mark.parametrize("compression", [None, "bf16", "fp16"])
@pytest.mark.parametrize("python_hook", [False, True], ids=["cpp_hook", "python_hook"])
def test_hook_averages_cuda_buckets(hook_runs, backend, world, compression, python_hook):
    by_rank = [results[compression, python_hook] for results in hook_runs(backend, world)]
    describe = by_rank[0][0]
    path = {"nccl": "premultiplied-sum", "gloo": "scale-then-sum"}[backend]
    assert describe.startswith(f"ddpx CUDA engine ({backend}): {path} all-reduce"), describe
    wire = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[compression]
    assert describe.endswith(f"; {str(wire).removeprefix('torch.') if wire else 'no compression'}")
    for step in range(2):
        grads, reference = by_rank[0][1][step]["ddpx"], by_rank[0][1][step]["default"]
        local = [steps[step]["local"] for _, steps in by_rank]
        for _, steps in by_rank[1:]:
            for mine, theirs in zip(grads, steps[step]["ddpx"], strict=True):
                assert torch.equal(mine, theirs), "ranks disagree on the averaged gradients"
        if world == 1:
            for want, own in zip(reference, local[0], strict=True):
                assert torch.equal(want, own), (
                    "DDP's default average of one rank differs from the rank's own gradients: "
                    "the backward is not deterministic here, so no exact comparison can hold")
        for i, (got, want) in enumerate(zip(grads, reference, strict=True)):
            if wire is None:
                # DDP's default multiplies every rank's bucket by float32(1 / world) and sums, as
                # ddpx's does (inside NCCL's premultiplied sum, or before gloo's sum): one or two
                # terms sum to the same bits in any order, and gloo sums both in its one order.
                _assert_same_bits(got, want)
                continue
            own = [grads_of_rank[i] for grads_of_rank in local]
            # The engine's contract, bit for bit: each rank's gradient scaled and cast to the
            # wire dtype, summed in rank order in float32, rounded once, widened.
            sent = torch.stack([(g * (1.0 / world)).to(wire) for g in own])
            _assert_same_bits(got, _reference_sum(sent).float())
            # And within the rounding bound of DDP's float32 average (same scale, float32(1 /
            # world)): with A the sum of the ranks' |scaled gradients|, the casts to the wire are
            # off by u_wire A at most and the final rounding by u_wire |result|; the products and
            # float32 sums of both (ddpx's and the default's) by 2 world u32 A; all that to first
            # order, which (1 + 2 u_wire) makes a bound; and each wire rounding of a subnormal by
            # half a subnormal step.
            u, u32 = _unit_roundoff(wire), _unit_roundoff(torch.float32)
            magnitude = torch.stack(own).double().abs().sum(0) / world
            bound = ((u * (magnitude + got.double().abs()) + 2 * world * u32 * magnitude)
                     * (1 + 2 * u) + (world + 1) * _half_subnormal_step(wire))
            _assert_within(got, want.double(), bound)


# DDP as users configure it, each case a dict of: DDP's options, the parameters' dtype, the
# wire, micro-steps accumulated under no_sync, an unused parameter, backward on a side stream.
DDP_CASES = {
    "bucket views": {"options": {"gradient_as_bucket_view": True}},
    "static graph": {"options": {"static_graph": True}},
    "unused parameter": {"options": {"find_unused_parameters": True}, "unused": True},
    "no_sync": {"accumulate": 2},
    "bf16 buckets": {"dtype": torch.bfloat16},
    "fp16 buckets": {"dtype": torch.float16},
    "bf16 buckets, fp16 wire": {"dtype": torch.bfloat16, "compression": "fp16"},
    "fp16 buckets, bf16 wire": {"dtype": torch.float16, "compression": "bf16"},
    "backward on a side stream": {"side_stream": True},
}


class _TwoLayers(torch.nn.Module):
    def __init__(self, unused: bool):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(67, 33), torch.nn.ReLU(),
                                        torch.nn.Linear(33, 5))
        self.unused = torch.nn.Linear(5, 5) if unused else None

    def forward(self, x):
        return self.body(x)


def _ddp_case(device: torch.device, case: dict) -> dict:
    """Two steps of one net under DDP with ddpx's hook, under DDP with its default all-reduce
    (float32 cases) and without DDP (this rank's own gradients): each step's gradients of each,
    None for a parameter without one."""
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddpx

    dtype = case.get("dtype", torch.float32)
    torch.manual_seed(0)
    net = _TwoLayers(case.get("unused", False)).to(device, dtype)
    device_ids = [device.index] if device.type == "cuda" else None
    models = {"local": copy.deepcopy(net)}
    if dtype == torch.float32:
        models["default"] = DistributedDataParallel(copy.deepcopy(net), device_ids=device_ids,
                                                    **case.get("options", {}))
    models["ddpx"] = DistributedDataParallel(net, device_ids=device_ids, bucket_cap_mb=0.004,
                                             **case.get("options", {}))
    ddpx.register_fused_hook(models["ddpx"], compression=case.get("compression"))
    side = torch.cuda.Stream() if case.get("side_stream") else None
    data = torch.Generator().manual_seed(dist.get_rank())
    accumulate = case.get("accumulate", 1)
    steps = []
    for _ in range(2):
        inputs = [torch.randn(16, 67, generator=data).to(device, dtype) for _ in range(accumulate)]
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            for micro, x in enumerate(inputs):
                last = micro == accumulate - 1
                quiet = (model.no_sync() if name != "local" and not last
                         else contextlib.nullcontext())
                with quiet, (torch.cuda.stream(side) if side else contextlib.nullcontext()):
                    model(x).float().square().sum().backward()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        steps.append({name: [None if p.grad is None else p.grad.cpu() for p in model.parameters()]
                      for name, model in models.items()})
    return steps


def _ddp_cases(rank, world, device_type):
    if device_type == "cpu":
        return "ran", {name: _ddp_case(torch.device("cpu"), case)
                       for name, case in DDP_CASES.items() if not case.get("side_stream")}
    device = torch.device("cuda", torch.cuda.current_device())
    return _unless_refused(lambda: {name: _ddp_case(device, case)
                                    for name, case in DDP_CASES.items()})


@pytest.fixture(scope="module")
def ddp_runs():
    """run(backend, world, device): every DDP case's results by rank."""
    return _launched_once(_ddp_cases, timeout=180)


DDP_GROUPS = [("gloo", 2, "cpu", [], "gloo-2-cpu"), ("nccl", 1, "cuda", [needs_gpu], "nccl-1"),
              ("nccl", 2, "cuda", [needs_two_gpus], "nccl-2"),
              ("gloo", 2, "cuda", [needs_gpu], "gloo-2-on-one-gpu")]


@pytest.mark.parametrize(("backend", "world", "device", "case"), [
    pytest.param(backend, world, device, case, marks=marks, id=f"{case}-{name}")
    for backend, world, device, marks, name in DDP_GROUPS for case in DDP_CASES
    if device == "cuda" or not DDP_CASES[case].get("side_stream")])
def test_ddp_options_and_16_bit_buckets(ddp_runs, backend, world, device, case):
    """The hook under DDP's options (bucket views, static graph, an unused parameter, no_sync
    accumulation, backward on a side stream) and on bf16/fp16 parameters, a wire of the other
    16-bit type too. float32: the bits of DDP's default all-reduce, which scales every rank's
    bucket by float32(1 / world) and sums as the engine does (one or two terms sum to the same
    bits in any order). 16-bit buckets: the engine's contract bit for bit, each rank's gradient
    scaled in float32 and cast to the wire, summed in rank order in float32 and rounded once
    (on a GPU to the wire, then cast to the bucket's dtype)."""
    by_rank = [results[case] for results in ddp_runs(backend, world, device)]
    dtype = DDP_CASES[case].get("dtype", torch.float32)
    wire = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        DDP_CASES[case].get("compression"), dtype)
    for step in range(2):
        grads = by_rank[0][step]["ddpx"]
        for other in by_rank[1:]:
            for mine, theirs in zip(grads, other[step]["ddpx"], strict=True):
                assert (mine is None and theirs is None) or torch.equal(mine, theirs), (
                    f"{case}: ranks disagree on the averaged gradients")
        if dtype == torch.float32:
            for i, (got, want) in enumerate(zip(grads, by_rank[0][step]["default"], strict=True)):
                assert (got is None) == (want is None), f"{case}: parameter {i}'s gradient"
                if got is not None:
                    _assert_same_bits(got.flatten(), want.flatten())
            continue
        for i, got in enumerate(grads):
            own = [steps[step]["local"][i].flatten() for steps in by_rank]
            sent = torch.stack([(g.float() * (1.0 / world)).to(wire) for g in own])
            # The CUDA engine all-gathers the sums in the wire dtype; the shared-memory engine
            # rounds them to the bucket's dtype straight from float32.
            summed = _reference_sum(sent) if device == "cuda" else _reference_sum(sent.float())
            _assert_same_bits(got.flatten(), summed.to(dtype))


def _on_another_gpu(rank, world):
    import ddpx

    torch.cuda.set_device(0)
    results = []
    for dtype, compression in ((torch.float32, None), (torch.float32, "bf16"),
                               (torch.bfloat16, None)):
        tensor = _values(4097).to(dtype).to("cuda:1")
        ddpx.all_reduce(tensor, average=True, compression=compression)
        results.append((tensor.device.index, torch.cuda.current_device(), tensor.cpu()))
    return results


@needs_two_gpus
def test_all_reduce_of_a_tensor_on_another_gpu_than_the_current_one():
    """A tensor on cuda:1 while cuda:0 is current: reduced on its own GPU, the current device
    left as it was."""
    [results] = run_ranks(_on_another_gpu, 1, backend="nccl", timeout=120)
    for (index, current, result), wire in zip(
            results, (torch.float32, torch.bfloat16, torch.bfloat16), strict=True):
        assert (index, current) == (1, 0)
        _assert_same_bits(result, _values(4097).to(wire).to(result.dtype))


def _groups_for_timeouts(rank, world, device):
    from datetime import timedelta

    import torch.distributed as dist

    from ddpx._timeouts import group_with_timeout

    world_group = dist.group.WORLD
    own = world_group._get_backend(torch.device(device)).options._timeout
    assert group_with_timeout(world_group, device, None) is world_group
    assert group_with_timeout(world_group, device, own) is world_group
    other = group_with_timeout(world_group, device, timedelta(seconds=7))
    tensor = torch.full((5,), float(rank + 1), device=device)
    dist.all_reduce(tensor, group=other)
    return (other._get_backend(torch.device(device)).options._timeout.total_seconds(),
            dist.get_process_group_ranks(other), tensor.cpu().tolist())


@pytest.mark.parametrize(("backend", "world", "device"), [
    pytest.param("gloo", 2, "cpu", id="gloo-2-cpu"),
    pytest.param("nccl", 1, "cuda", marks=needs_gpu, id="nccl-1")])
def test_an_engine_timeout_other_than_the_groups_is_its_own_groups(backend, world, device):
    """NCCL reads no per-call timeout, nor does gloo's all-to-all: the CUDA engine asked for a
    timeout other than its group's runs on a group of the same ranks made with it."""
    for timeout, ranks, reduced in run_ranks(_groups_for_timeouts, world, device,
                                             backend=backend):
        assert (timeout, ranks) == (7.0, list(range(world)))
        assert reduced == [world * (world + 1) / 2] * 5
