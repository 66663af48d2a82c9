"""Seeded inputs shared by the GPU tests of every framework (NumPy only, so that a test of one framework never has
to import another's)."""
import numpy as np


def qkv_do(seed, B, Hq, Hkv, Nq, Nk, D, layout, sigma=1.0):
    """q, k, v, dO as float64 arrays, ``(B, H, N, D)`` for HND or ``(B, N, H, D)`` for NHD: standard normal draws, q
    and k scaled by ``sigma``, k with a common per-channel offset (0.5 sigma), so that K-smoothing matters."""
    rng = np.random.default_rng(seed)

    def shape(h, n):
        return (B, h, n, D) if layout == "HND" else (B, n, h, D)

    q = rng.standard_normal(shape(Hq, Nq)) * sigma
    k = rng.standard_normal(shape(Hkv, Nk)) * sigma + 0.5 * sigma * rng.standard_normal((1, 1, 1, D))
    v = rng.standard_normal(shape(Hkv, Nk))
    do = rng.standard_normal(shape(Hq, Nq))
    return q, k, v, do
