"""The GPU path. Every .cu file compiles with this machine's nvcc, GPU or not, so a CUDA compile
error fails CI anywhere. The kernels round and sum exactly as plain torch does; their tests share
one body with the CPU kernels of the same contract, so the bodies run without a GPU too. The
fused hook and ddpx.all_reduce reduce CUDA tensors over NCCL (on 1 GPU, and on 2 if there are)."""

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
        C.kernel_pack(dst, src, scale, C.kernel_isa())


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
    actual, expected = actual.cpu(), expected.cpu()
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN in different places"
    view = {4: torch.int32, 2: torch.int16}[expected.element_size()]
    differ = (actual.view(view) != expected.view(view)) & ~nan
    assert not differ.any(), (
        f"{int(differ.sum())} of {expected.numel()} elements differ, first at "
        f"{int(differ.nonzero()[0])}: {actual[differ][0].item()} vs {expected[differ][0].item()}")


def _unaligned(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.empty(n + 1, dtype=dtype, device=device)[1:]


@pytest.fixture
def kernels_on(request):
    device = request.param
    if device == "cuda":
        assert C.has_cuda_kernels, ("ddpx._C was built without its CUDA kernels on a machine with "
                                    "a GPU: build it with a CUDA torch and a CUDA toolkit")
    return device


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
        # Unaligned pointers take the scalar path.
        dst, moved = _unaligned(n, dst_dtype, kernels_on), _unaligned(n, src_dtype, kernels_on)
        moved.copy_(src)
        _scale_cast(dst, moved, 0.25)
        _assert_same_bits(dst, (src.float() * 0.25).to(dst_dtype))


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


ALL_REDUCE_CASES = [(n, dtype, compression) for n in (0, 1, 7, 4097, 1_000_003)
                    for dtype, compression in ((torch.float32, "bf16"), (torch.float32, "fp16"),
                                               (torch.bfloat16, None), (torch.float16, None),
                                               (torch.float32, None))]


def _gpu_all_reduce(rank, world):
    import ddpx

    results = []
    for n, dtype, compression in ALL_REDUCE_CASES:
        tensor = _values(n, seed=rank).to(dtype).cuda()
        ddpx.all_reduce(tensor, average=True, compression=compression)
        results.append(tensor.cpu())
    return results


@needs_gpu
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=needs_two_gpus)])
def test_gpu_all_reduce_matches_reference(world):
    by_rank = run_ranks(_gpu_all_reduce, world, backend="nccl", timeout=300)
    for case, (result, *others) in zip(ALL_REDUCE_CASES, zip(*by_rank, strict=True), strict=True):
        n, dtype, compression = case
        for other in others:
            _assert_same_bits(other, result)  # every rank gets the same bits
        inputs = [_values(n, seed=r).to(dtype) for r in range(world)]
        if compression is None and dtype == torch.float32:
            # NCCL's premultiplied sum, in NCCL's order.
            expected = sum(x.double() * (1.0 / world) for x in inputs)
            torch.testing.assert_close(result.double(), expected, rtol=1e-6, atol=0,
                                       equal_nan=True, msg=f"{case}")
        else:
            # Each rank's input scaled and cast to the wire dtype, summed in rank order in
            # float32, rounded once, widened.
            wire = {"bf16": torch.bfloat16, "fp16": torch.float16, None: dtype}[compression]
            sent = torch.stack([(x.float() * (1.0 / world)).to(wire) for x in inputs])
            _assert_same_bits(result, _reference_sum(sent).to(dtype))


def _hook_step(rank, world, compression, python_hook):
    from torch.nn.parallel import DistributedDataParallel

    import ddpx

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1031, 301), torch.nn.ReLU(),
                              torch.nn.Linear(301, 7)).cuda()
    reference = DistributedDataParallel(copy.deepcopy(net), device_ids=[rank])
    # One bucket in the first step; DDP rebuilds them for the second: 2114, 301 and 310331 elements.
    model = DistributedDataParallel(net, device_ids=[rank], bucket_cap_mb=0.001)
    if python_hook:
        state = ddpx.FusedHookState(compression=compression, device="cuda")
        model.register_comm_hook(state, ddpx.fused_allreduce_hook)
    else:
        state = ddpx.register_fused_hook(model, compression=compression)
    x = torch.randn(16, 1031, generator=torch.Generator().manual_seed(rank)).cuda()
    for _ in range(2):
        for ddp in (model, reference):
            ddp(x).square().sum().backward()
    torch.cuda.synchronize()
    return (state.describe(), [p.grad.cpu() for p in model.parameters()],
            [p.grad.cpu() for p in reference.parameters()])


@needs_gpu
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=needs_two_gpus)])
@pytest.mark.parametrize("compression", [None, "bf16", "fp16"])
@pytest.mark.parametrize("python_hook", [False, True], ids=["cpp_hook", "python_hook"])
def test_hook_averages_cuda_buckets(world, compression, python_hook):
    by_rank = run_ranks(_hook_step, world, compression, python_hook, backend="nccl", timeout=300)
    describe, grads, reference = by_rank[0]
    assert "CUDA engine" in describe
    tolerance = {None: 1e-5, "bf16": 1e-2, "fp16": 2e-3}[compression]
    for got, want in zip(grads, reference, strict=True):
        atol = tolerance * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=tolerance, atol=atol)
    for _, other, _ in by_rank[1:]:
        for mine, theirs in zip(grads, other, strict=True):
            assert torch.equal(mine, theirs), "ranks disagree on the averaged gradients"
