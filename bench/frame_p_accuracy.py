"""What quantizing P relative to the softmax frame instead of each tile's max would cost in accuracy (CPU, float64
reference; bench/NOTES.md, eleventh session). Not a kernel option: a question asked before writing one.

    python bench/frame_p_accuracy.py [--n 2048] [--heads 4] [--causal]

Per σ of SPEC §7's sweep (Q, K ~ N(0, σ²), V ~ N(0, 1)), the relative L2 error of O against exact float64
attention for three ways to form P^ over 64-key tiles, all with the default config's Q, K, V codes and scales:
- "tile" (the default, SPEC §3): P^_t = rint(255 exp(S - r_t)), r_t the tile's row max, weight exp(r_t - M) / 255;
- "frame": P^_t = rint(255 exp(S - f_t)), f_t = max(r_0 .. r_t) the running max when tile t is taken (the order
  of the kernels), weight exp(f_t - M) / 255. One scale per run of tiles between two moves of the max, so P.V
  could accumulate in int32 across them;
- "row": P^ = rint(255 exp(S - M)) with the final row max M (the coarsest: one scale per row), for scale.
The row sum is the unquantized one in all three, as in the kernels.
"""
import argparse

import numpy as np

from sagecupy.config import DEFAULT
from sagecupy.reference import attention as ref_attn
from sagecupy.reference import sagebwd


def o_variants(S, pv, bkv=64, p_max=255.0):
    """O of one head for the three P^ rules; S (Nq, Nk) logits (-inf invisible), pv = V^ * s_V (Nk, D)."""
    Nq, Nk = S.shape
    T = -(-Nk // bkv)
    tiles = np.full((Nq, T * bkv), -np.inf)
    tiles[:, :Nk] = S
    tiles = tiles.reshape(Nq, T, bkv)
    r = tiles.max(axis=-1)                                 # r_t
    f = np.maximum.accumulate(r, axis=1)                   # f_t: the running max when tile t is taken
    M = r.max(axis=1)
    seen = M != -np.inf
    Ms = np.where(seen, M, 0.0)
    l = np.exp(S - Ms[:, None]).sum(axis=1)
    out = {}
    for name, ref in (("tile", r), ("frame", f), ("row", np.broadcast_to(Ms[:, None], r.shape))):
        ok = ref != -np.inf
        rs = np.where(ok, ref, 0.0)
        codes = np.rint(p_max * np.exp(tiles - rs[..., None]))
        w = np.where(ok, np.exp(rs - Ms[:, None]), 0.0) / p_max
        a = (codes * w[..., None]).reshape(Nq, T * bkv)[:, :Nk]
        out[name] = np.where(seen[:, None], (a @ pv) / np.where(seen, l, 1.0)[:, None], 0.0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"B=1 H={a.heads} N={a.n} D={a.d} causal={a.causal}: O rel_l2 vs exact attention, P^ per 64-key tile / "
          f"per frame / per row")
    for sigma in (1.0, 3.0, 5.0, 8.0, 10.0):
        q = rng.standard_normal((1, a.heads, a.n, a.d)) * sigma
        k = rng.standard_normal((1, a.heads, a.n, a.d)) * sigma
        v = rng.standard_normal((1, a.heads, a.n, a.d))
        exact = ref_attn.attention_forward(q, k, v, causal=a.causal)
        exact = exact[0] if isinstance(exact, tuple) else exact
        o_ref, res, inter = sagebwd.forward(q, k, v, causal=a.causal, config=DEFAULT, return_intermediates=True)
        qi = sagebwd.quantize_inputs(q, k, v, config=DEFAULT)
        errs = {"tile": [0.0, 0.0], "frame": [0.0, 0.0], "row": [0.0, 0.0]}
        for h in range(a.heads):
            pv = qi["v_codes"][0, h] * qi["v_scale"][0, h][0][None, :]  # per-channel V scales
            outs = o_variants(inter["S"][0, h], pv)
            # "tile" is the reference simulator's own O (the default config), up to float64 rounding
            assert np.allclose(outs["tile"], o_ref[0, h], rtol=1e-9, atol=1e-12)
            for name, o in outs.items():
                errs[name][0] += float(np.sum((o - exact[0, h]) ** 2))
                errs[name][1] += float(np.sum(exact[0, h] ** 2))
        print(f"sigma={sigma:>4}: " + "  ".join(f"{n} {np.sqrt(e / d):.4f}" for n, (e, d) in errs.items()), flush=True)


if __name__ == "__main__":
    main()
