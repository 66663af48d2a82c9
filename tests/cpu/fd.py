"""Central finite differences, shared by the reference gradient tests."""
import numpy as np


def fd_grad(f, x, h=1e-5):
    """Central finite differences of the scalar ``f`` with respect to every element of ``x`` (float64)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp = x.copy()
        xp[idx] += h
        xm = x.copy()
        xm[idx] -= h
        g[idx] = (f(xp) - f(xm)) / (2 * h)
    return g
