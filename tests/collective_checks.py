"""What the backend's tests check collectives with, inside the ranks: each rank's input (the
same in every process), exact references, comparisons that report every wrong case of a run
(collecting()), the digest every rank must hold, and the calls the backend served by route.
test_backend.py and test_multinode.py share them."""

import contextlib
import functools
import hashlib
import math
import warnings
import zlib

import torch
import torch.distributed as dist
from test_engine import HALF_ULP, assert_close_to_sum, fingerprint

from ddpx import backend_of

# Half the smallest subnormal: the absolute rounding error of a result that lands there.
TINY = {torch.float32: 2.0**-150, torch.float64: 0.0, torch.bfloat16: 2.0**-134,
        torch.float16: 2.0**-25}
R = dist.ReduceOp


def make(rank: int, shape, dtype: torch.dtype, salt: str = "", kind: str = "normal"):
    """Rank ``rank``'s input for a case, the same in every process (crc32, not hash(): that is
    salted per process). Floats: N(0, (rank+1)^2), or +-{1/2, 1, 2} (``kind="pow2"``: products
    stay exact); ints in [-50, 50), uint8 over its whole range, bools half true."""
    shape = tuple(shape)
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{shape}/{dtype}/{salt}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, generator=g, dtype=dtype)
    if kind == "pow2":
        choices = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], dtype=torch.float64)
        return choices[torch.randint(0, 6, shape, generator=g)].to(dtype)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * (rank + 1)).to(dtype)


def is_pow2(scale: float) -> bool:
    return scale > 0 and math.frexp(scale)[0] == 0.5


def rank_order_sum(inputs, scale: float = 1.0) -> torch.Tensor:
    """The spec's float reduction, exactly: every input scaled, summed in float32 (float64 for
    float64 data) in rank order 0, 1, 2, ..., rounded once into the inputs' dtype."""
    dtype = inputs[0].dtype
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = inputs[0].to(acc_dtype) * scale
    for x in inputs[1:]:
        acc = acc + x.to(acc_dtype) * scale
    return acc.to(dtype)


def exact_reduction(inputs, op: str) -> torch.Tensor:
    """MIN/MAX/PRODUCT/SUM/BAND/BOR/BXOR without any rounding (floats: pow2 inputs for PRODUCT),
    in the inputs' dtype; integer SUM/PRODUCT wrap like the dtype's own arithmetic."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(inputs).to(torch.uint8)
        if op in ("MIN", "BAND", "PRODUCT"):
            return stack.amin(0).bool()
        if op in ("MAX", "BOR", "SUM"):
            return stack.amax(0).bool()
        return (stack.sum(0) % 2).bool()  # BXOR
    stack = torch.stack(inputs)
    if op == "MIN":
        return stack.amin(0)
    if op == "MAX":
        return stack.amax(0)
    if dtype.is_floating_point:
        assert op == "PRODUCT"
        return stack.double().prod(0).to(dtype)
    if op == "SUM":
        return stack.sum(0).to(dtype)
    if op == "PRODUCT":
        return stack.prod(0).to(dtype)
    bitwise = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
    return functools.reduce(bitwise[op], inputs)


def make_op(name: str):
    if name.startswith("PREMUL_SUM"):
        return dist._make_nccl_premul_sum(float(name[len("PREMUL_SUM("):-1]))
    return getattr(R, name)


def op_scale(name: str, world: int) -> float:
    if name == "AVG":
        return 1.0 / world
    if name.startswith("PREMUL_SUM"):
        return float(name[len("PREMUL_SUM("):-1])
    return 1.0


# Inside collecting(), value checks append their failures here instead of raising at the first,
# so one run reports every wrong case: a check runs after its collective has completed on every
# rank and changes nothing the ranks do next, so they stay in step. A collective that raises
# still ends the run.
_collected: list | None = None


@contextlib.contextmanager
def collecting():
    global _collected
    _collected = []
    try:
        yield _collected
    finally:
        # A pool's rank runs other bodies next, whose checks must raise.
        _collected = None


def fail(message: str) -> None:
    if _collected is None:
        raise AssertionError(message)
    _collected.append(message)


def check(ok: bool, message: str) -> None:
    if not ok:
        fail(message)


def expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        fail(f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
        return
    if got.dtype == torch.bool:  # gloo's bool SUM leaves bytes of 2: compare truth values
        got, want = got.view(torch.uint8) != 0, want.view(torch.uint8) != 0
    if not torch.equal(got, want):
        bad = (got != want).flatten().nonzero().flatten()
        first = bad[0].item()
        fail(f"{what}: {bad.numel()} of {got.numel()} elements differ; first at {first}: got "
             f"{got.flatten()[first].item()!r}, want {want.flatten()[first].item()!r}")


def close_to_sum(out, inputs, scale: float, what: str) -> None:
    """test_engine's float64 bound, for SUM and scales that are powers of two (exact)."""
    try:
        assert_close_to_sum(out, inputs, scale)
    except AssertionError as error:
        fail(f"{what}: {error}")


def _bound_check(err, bound, what):
    if err.numel() and not bool((err <= bound).all()):
        worst = (err - bound).argmax()
        fail(f"{what}: error {err.flatten()[worst].item()} > bound "
             f"{bound.flatten()[worst].item()} at {worst.item()}")


def close_to_scaled_sum(out, inputs, scale: float, what: str) -> None:
    """For scales that are not powers of two (AVG at 3 ranks, PREMUL_SUM(0.3)): assert_close_
    to_sum's bound plus two roundings of each term (the scale's own in float32 and the product),
    2 eps of each term's magnitude, and half a subnormal for a result that lands there."""
    terms = [x.double() * scale for x in inputs]
    exact = sum(terms)
    magnitude = sum(t.abs() for t in terms)
    eps = 2.0**-53 if out.dtype == torch.float64 else 2.0**-24
    bound = ((len(inputs) + 1) * eps * magnitude + HALF_ULP[out.dtype] * exact.abs()
             + TINY[out.dtype])
    _bound_check((out.double() - exact).abs(), bound, what)


def close_to_gloo(out, theirs, inputs, scale: float, what: str) -> None:
    """ddpx against gloo where their summation orders may differ (3+ ranks, or rounding in the
    data's dtype): each is within its own rounding bound of the exact sum, so they are within the
    sum of both bounds of each other. ddpx: the bound of close_to_scaled_sum. gloo: its partial
    sums may be rounded in the data's dtype (unit roundoff u per addition, at most the sum of
    magnitudes), and AVG divides the rounded sum, rounding again: (world+1) max(eps, u) of the
    magnitude plus 2u of the result."""
    terms = [x.double() * scale for x in inputs]
    exact = sum(terms)
    magnitude = sum(t.abs() for t in terms)
    world, dtype = len(inputs), out.dtype
    eps = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    u = HALF_ULP[dtype]
    ours = (world + 1) * eps * magnitude + u * exact.abs() + TINY[dtype]
    gloos = (world + 1) * max(eps, u) * magnitude + 2 * u * exact.abs() + TINY[dtype]
    _bound_check((out.double() - theirs.double()).abs(), ours + gloos, what + " vs gloo")


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(fingerprint(t)).hexdigest()[:20]


class Routes:
    """How many calls of each collective the backend's engine and its inner gloo served since
    this was made: {name: (engine, gloo)}, names with no calls left out."""

    def __init__(self, group=None):
        self.backend = backend_of(group)
        self.start = self._now()

    def _now(self):
        return {name: (int(v.get("engine", 0)), int(v.get("gloo", 0)))
                for name, v in self.backend.routes().items()}

    def served(self):
        now = self._now()
        out = {}
        for name in set(now) | set(self.start):
            engine = now.get(name, (0, 0))[0] - self.start.get(name, (0, 0))[0]
            gloo = now.get(name, (0, 0))[1] - self.start.get(name, (0, 0))[1]
            if engine or gloo:
                out[name] = (engine, gloo)
        return out


def quiet():
    # torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor: the spec's names.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
