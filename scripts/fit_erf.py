"""The coefficients of dcs_erf (engine/src/backends/dcs_math.h) and their
check, and the check of dcs_exp (Taylor coefficients, nothing fitted).

    python scripts/fit_erf.py          # prints the C lines and the float32 errors

erf is fitted in two pieces, each a Chebyshev least-squares fit in float64
(numpy) turned into monomials of a variable on [-1, 1] or [0, 1]:
  |x| < 1:      erf(x) = x * P(x^2),        P of degree 5 in u = x^2;
  1 <= |x| < 4: erf(x) = Q((|x| - 2.5) / 1.5), Q of degree 12;
  |x| >= 4:     1 (erf(4) = 1 - 1.5e-8 rounds to 1 in float32).
The check evaluates the pieces exactly as dcs_erf does (float32, Horner, a
multiply and an add rounded apart: no FMA) on 2M points of [0, 5] against
math.erf in float64 and prints the largest absolute error.
"""

import math

import numpy as np
from numpy.polynomial import chebyshev as C

P_DEG, Q_DEG, SPLIT, TOP = 5, 12, 1.0, 4.0
MID, HALF = (SPLIT + TOP) / 2, (TOP - SPLIT) / 2


def cheb_nodes(n=4000):
    return np.cos(np.pi * (np.arange(n) + 0.5) / n)


def coefficients():
    erf = np.vectorize(math.erf)
    t = cheb_nodes()
    u = (t + 1) / 2 * SPLIT**2  # u = x^2 on [0, 1]
    x = np.sqrt(u)
    p = C.cheb2poly(C.chebfit(t, erf(x) / x, P_DEG))  # in t
    # P in u directly: t = 2u / SPLIT^2 - 1 (SPLIT = 1: t = 2u - 1)
    p_u = np.polynomial.polynomial.Polynomial(p)(np.polynomial.polynomial.Polynomial([-1.0, 2.0 / SPLIT**2])).coef
    q = C.cheb2poly(C.chebfit(t, erf(t * HALF + MID), Q_DEG))
    return np.float32(p_u), np.float32(q)


def horner(c, x):
    r = np.full_like(x, c[-1])
    for k in c[-2::-1]:
        r = (r * x).astype(np.float32) + k
    return r.astype(np.float32)


def erf32(x, p, q):
    """dcs_erf, op for op, in float32."""
    a = np.abs(x).astype(np.float32)
    small = a * horner(p, (a * a).astype(np.float32))
    t = ((np.minimum(a, np.float32(TOP)) - np.float32(MID)) * np.float32(1 / HALF)).astype(np.float32)
    large = np.minimum(horner(q, t), np.float32(1))
    r = np.where(a < SPLIT, small, np.where(a < TOP, large, np.float32(1)))
    return np.copysign(r, x).astype(np.float32)


def exp32(x):
    """dcs_exp, op for op, in float32 (x <= 0 here: the softmax's arguments)."""
    f = np.float32
    xc = np.clip(x, f(-87.33654), f(88.7)).astype(f)
    n = ((xc * f(1.44269504)).astype(f) + f(12582912.0)).astype(f) - f(12582912.0)
    r = ((xc - (n * f(0.693145752)).astype(f)).astype(f) - (n * f(1.42860677e-6)).astype(f)).astype(f)
    c = [f(v) for v in (1.0, 1.0, 0.5, 1.66666667e-1, 4.16666667e-2, 8.33333333e-3, 1.38888889e-3, 1.98412698e-4)]
    p = horner(c, r)
    two_n = ((n.astype(np.int32) + 127) << 23).view(f)
    e = (p * two_n).astype(f)
    return np.where(x < f(-87.33654), f(0), e)


def main():
    p, q = coefficients()
    x = np.linspace(0, 5, 2_000_001, dtype=np.float32)
    err = np.max(np.abs(erf32(x, p, q).astype(np.float64) - np.vectorize(math.erf)(x.astype(np.float64))))
    fmt = lambda c: ", ".join("%.9gf" % v for v in c)  # noqa: E731  (9 digits: float32 round trip)
    print("P (x^2), degree %d: {%s}" % (P_DEG, fmt(p)))
    print("Q ((|x| - %.1f) / %.1f), degree %d: {%s}" % (MID, HALF, Q_DEG, fmt(q)))
    print("max |dcs_erf - erf| on [0, 5]: %.3g" % err)
    x = -np.linspace(0, 87.3, 2_000_001, dtype=np.float32)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    print("max |dcs_exp - exp| on [-87.3, 0]: %.3g ulp" % np.max(np.abs(exp32(x) - ref) / ulp))


if __name__ == "__main__":
    main()
