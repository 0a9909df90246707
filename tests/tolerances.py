"""Float tolerances from an error model, not from what one CPU happened to give.

Every float comparison of an engine result (float32) uses a bound built here,
from the float32 unit roundoff, the length of the longest reduction feeding
the compared values and the number of such reductions chained between the
inputs and them (the depth). The same bound must hold for every summation
order, so on any BLAS kernel (OpenBLAS Haswell, SkylakeX, Cooperlake,
SapphireRapids...) and any thread split.

The model
---------
u = 2^-24, the unit roundoff of float32 (half its machine epsilon).

One reduction: a float32 dot product / sum of n terms of either sign, in any
order, differs from the exact one by a sum of n rounding errors, each at most
u times a partial sum. Taken as independent (the standard probabilistic
model, Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
sec. 3.6; Higham & Mary 2019), their sum has a standard deviation of about
u * sqrt(n) times the typical size of the result. The worst case, n * u, is
never approached by blocked BLAS sums and would make the tests blind.

Many outputs: the largest of M such errors is about z(M) = sqrt(2 ln M)
standard deviations (the expected maximum of M Gaussians), plus 1 of margin.

Depth: a value at the end of a chain of `depth` reductions (per layer: the
QKV GEMM, the scores, the softmax-weighted sum, the compose, the output
GEMM, the two MLP GEMMs...) carries every stage's error, propagated with a
gain of at most COND per stage (LayerNorm divides by a row's standard
deviation and the softmax's exp turns an absolute error of a score into a
relative one of a weight: with the fixtures' activations of order 1 and
scores of a few units, their gain is below COND). The stages' errors are
independent as well, so they add in quadrature: sqrt(depth) * COND.

So: |a - b| <= f32_tol(n, depth, M) * max|b|, with f32_tol the product of
u, sqrt(n), z(M), sqrt(depth) and COND, and twice that when both sides are
float32 results of different summation orders (each carries its own error).
Against tests/reference.py (float64) only the engine's side counts.

Lower bounds on a difference (``> x``: "the intervention changed the
result") are not tolerances: they are checked to be far above any rounding
bound (``assert_effect``).
"""

from __future__ import annotations

import math

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff (np.finfo(np.float32).eps / 2)
U64 = 2.0**-53  # float64 unit roundoff (numpy-side recomputations)
U16 = 2.0**-11  # float16 unit roundoff (weights shipped as float16)
COND = 4.0  # error gain of one stage (LayerNorm, softmax) on the fixtures' activations


def z(outputs: int) -> float:
    """Standard deviations covering the largest of `outputs` independent errors."""
    return math.sqrt(2.0 * math.log(max(int(outputs), 2))) + 1.0


def f32_tol(n: int, depth: int = 1, outputs: int = 1, sides: int = 1) -> float:
    """Relative bound (to max |result|) on the rounding error of a float32
    result after `depth` chained reductions of length <= n, the largest of
    `outputs` values; sides=2 when both compared results are float32 of
    different summation orders."""
    return sides * U32 * math.sqrt(max(n, 1)) * z(outputs) * math.sqrt(max(depth, 1)) * COND


def f64_tol(n: int, depth: int = 1, outputs: int = 1, sides: int = 2) -> float:
    """f32_tol's model in float64: two numpy computations of one quantity
    from the same float32 inputs, in different orders (vectorised vs looped)."""
    return f32_tol(n, depth, outputs, sides) * U64 / U32


# make_tiny's defaults (dclens.testing.make_tiny): D 32, F 4 D, N 4, V 64
TINY = dict(dim=32, intermediate_size=128, n_layer=2, vocab_size=64)


def tiny(**kw) -> dict:
    """A config dict for forward_tol: make_tiny's defaults updated with kw."""
    c = dict(TINY, **kw)
    if "dim" in kw and "intermediate_size" not in kw:
        c["intermediate_size"] = 4 * kw["dim"]
    return c


def forward_depth(n_layer: int) -> int:
    """Chained reductions of a forward pass: per layer LayerNorm, QKV, QK^T,
    the compose (pre and post), softmax, the weighted sum of V, the output
    projection and the two MLP GEMMs (9), then the final norm and unembedding."""
    return 9 * n_layer + 2


def forward_tol(cfg: dict, T: int, outputs: int, sides: int = 1) -> float:
    """f32_tol of a whole forward pass of a checkpoint config (model-spec keys,
    either naming) over T positions."""
    D = cfg.get("dim") or cfg.get("hidden_size")
    F = cfg.get("intermediate_size") or 4 * D
    L = cfg.get("n_layer") or cfg.get("num_hidden_layers")
    return f32_tol(max(D, F, T), forward_depth(L), outputs, sides)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (in float64)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def assert_close(got, want, tol: float, what: str = "") -> None:
    """rel_err(got, want) <= tol, with both numbers in the message."""
    e = rel_err(got, want)
    assert e <= tol, "%s: relative error %.3g > bound %.3g" % (what, e, tol)


def assert_effect(got, base, bound: float, what: str = "") -> None:
    """The relative change from base is above `bound`: an effect, not rounding."""
    e = rel_err(got, base)
    assert e > bound, "%s: relative change %.3g is not above %.3g" % (what, e, bound)


def backward_tol(cfg: dict, T: int, outputs: int, sides: int = 2) -> float:
    """f32_tol of a forward pass and its backward (twice the chained
    reductions: every forward stage has a backward with its own sums) of a
    checkpoint config over T positions; sides=2: two float32 backends."""
    D = cfg.get("dim") or cfg.get("hidden_size")
    F = cfg.get("intermediate_size") or 4 * D
    L = cfg.get("n_layer") or cfg.get("num_hidden_layers")
    return f32_tol(max(D, F, T), 2 * forward_depth(L), outputs, sides)
