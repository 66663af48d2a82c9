"""Exhaustive numpy check of the fast NVFP4 rounding in kernels_cu/common/fp4.cuh (nvfp4_fq8, nvfp4_block_exact16):
for every fp16 value and every fp32-normal bf16 value, both signs, and every nonzero finite E4M3 scale s,

    y = snap16(|x| * rcp_rn(s)),  q = e2m1_round_nonneg(y)        (fp32 arithmetic, emulated exactly)
    value: q * s          == reference  s * e2m1_round(x / s)      (nvfp4_fq8)
    code:  byte of E4M3(copysign(q, x) * 2^-6) -> E2M1 code  == reference e2m1_encode(x / s)  (nvfp4_block_exact16)

and that without the snap the check fails (so it can tell). Also the scaled form nvfp4_block_exact16 uses
(2^-6 folded into 1/s and the magic number: y = snap16(|x| * (rcp_rn(s) * 2^-6)), M = 2^(16 +
max(e, 0)), min(., 6 * 2^-6)), and its scale E4M3(amax * fp32(1/6)) against E4M3(amax / 6) in float64 for every
fp16 and bf16 amax; and nvfp4_block_cmp's binary search on general fp32 values against the
reference's codes. ~2 minutes on a laptop:
    python bench/tools/fp4_fast_rounding_check.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sagecupy.reference import fp4 as F  # noqa: E402

f32 = np.float32


def e2m1_round_nonneg(a):
    """fp4.cuh e2m1_round_nonneg: a + M - M with M = 2^(22 + max(e, 0)), then min(., 6)."""
    e = (a.view(np.uint32) & np.uint32(0x7F800000)).astype(np.int64)
    m = np.maximum(e + (22 << 23), 0x4A800000).astype(np.uint32).view(f32)
    with np.errstate(invalid="ignore", over="ignore"):
        r = ((a + m).astype(f32) - m).astype(f32)
    return np.fmin(r, f32(6))


def e2m1_round_x64(a):
    """fp4.cuh e2m1_round_nonneg_unsat<-6>, then min(., 6 * 2^-6): the grid times 2^-6."""
    e = (a.view(np.uint32) & np.uint32(0x7F800000)).astype(np.int64)
    m = np.maximum(e + (22 << 23), 0x47800000).astype(np.uint32).view(f32)
    with np.errstate(invalid="ignore", over="ignore"):
        r = ((a + m).astype(f32) - m).astype(f32)
    return np.fmin(r, f32(6 * 2.0 ** -6))


def check_scaled():
    """Codes of the scaled form against the reference encoder (every nonzero finite scale, both formats)."""
    scales = F.e4m3_decode(np.arange(1, 0x7F)).astype(f32)
    bad = {}
    for name in ("fp16", "bf16"):
        x = values(name)
        n_code = 0
        for s in scales:
            r6 = (f32(1.0 / np.float64(s)) * f32(2.0 ** -6)).astype(f32)
            with np.errstate(over="ignore"):
                y = (np.abs(x) * r6).astype(f32)
            y = np.where(y < np.finfo(f32).tiny, f32(0), y)  # -ftz
            yb = (y.view(np.uint32) + np.uint32(0x40)) & np.uint32(0xFFFFFF80)
            q = e2m1_round_x64(yb.view(f32))
            byte = F.e4m3_encode(np.copysign(q, x).astype(np.float64)).astype(np.uint32)
            code = ((byte >> 2) & 7) | ((byte >> 4) & 8)
            n_code += int(np.sum(code != F.e2m1_encode(x.astype(np.float64) / np.float64(s))))
        bad[name] = n_code
    return bad


def check_scale_by_mul():
    """E4M3(fp32(amax * fp32(1/6))) == E4M3(amax / 6) (float64) for every finite fp16 and bf16 amax >= 0."""
    out = {}
    for name in ("fp16", "bf16"):
        a = values(name)
        a = a[a >= 0]
        ref = F.e4m3_encode(a.astype(np.float64) / 6.0)
        got = F.e4m3_encode((a * f32(1.0 / 6.0)).astype(f32).astype(np.float64))
        out[name] = int(np.sum(ref != got))
    return out


def check_cmp_bsearch(ties_wrong=False):
    """nvfp4_block_cmp's codes for general fp32 |x| (K after its mean): the binary search
    (m >= 4?, then m >= 6 or m >= 2?, then the odd threshold between) against the reference's code of |x| / s in
    float64, for every nonzero finite E4M3 scale s and |x| at and within 8 ulps of every threshold m s plus random
    magnitudes in [0, 7 s]. ties_wrong (a control, must mismatch): > instead of >= at the even thresholds."""
    rng = np.random.default_rng(0)
    mults = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=f32)
    bad = 0
    for s in F.e4m3_decode(np.arange(1, 0x7F)).astype(f32):
        t = (mults * s).astype(f32)  # exact: at most 7 significant bits
        near = [t]
        for d in (np.inf, 0):
            x = t
            for _ in range(8):
                x = np.nextafter(x, f32(d))
                near.append(x)
        a = np.concatenate(near + [rng.uniform(0, 7 * float(s), 2000).astype(f32), np.array([0, 6 * s, 448 * 7], f32)])
        a = a[(a == 0) | (a >= np.finfo(f32).tiny)].astype(f32)  # (flushed subnormals)
        ge = (lambda x, y: x > y) if ties_wrong else (lambda x, y: x >= y)
        b1 = ge(a, t[3])
        b2 = ge(a, np.where(b1, t[5], t[1]))
        m = 4 * b1 + 2 * b2 + (a > np.where(b1, np.where(b2, t[6], t[4]), np.where(b2, t[2], t[0])))
        bad += int(np.sum(m != (F.e2m1_encode(a.astype(np.float64) / np.float64(s)) & 7)))
    return bad


def values(name):
    if name == "fp16":
        a = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(f32)  # +0 .. the largest finite
    else:
        a = (np.arange(0, 0x7F80, dtype=np.uint32) << 16).view(f32)
        a = a[(a == 0) | (a >= np.finfo(f32).tiny)]  # the kernels flush fp32 subnormals (CuPy's -ftz=true)
    return np.concatenate([a, -a])


def check(snap=True):
    scales = F.e4m3_decode(np.arange(1, 0x7F)).astype(f32)
    bad = {}
    for name in ("fp16", "bf16"):
        x = values(name)
        n_val = n_code = 0
        for s in scales:
            r = f32(1.0 / np.float64(s))  # __frcp_rn
            with np.errstate(over="ignore"):
                y = (np.abs(x) * r).astype(f32)
            fin = np.isfinite(y)
            yb = y.view(np.uint32).copy()
            if snap:
                yb[fin] = (yb[fin] + np.uint32(0x40)) & np.uint32(0xFFFFFF80)
            q = e2m1_round_nonneg(np.where(fin, yb.view(f32), f32(np.inf)))
            exact = x.astype(np.float64) / np.float64(s)
            n_val += int(np.sum(np.abs(q.astype(np.float64)) * s != np.abs(F.e2m1_round(exact)) * s))
            byte = F.e4m3_encode((np.copysign(q, x) * f32(2.0 ** -6)).astype(np.float64)).astype(np.uint32)
            code = ((byte >> 2) & 7) | ((byte >> 4) & 8)
            n_code += int(np.sum(code != F.e2m1_encode(exact)))
        bad[name] = (n_val, n_code)
    return bad


if __name__ == "__main__":
    got = check(True)
    print("with the snap   (value, code mismatches):", got)
    ctrl = check(False)
    print("without the snap (control, must be > 0):", ctrl)
    scaled = check_scaled()
    print("scaled form (code mismatches):", scaled)
    mul = check_scale_by_mul()
    print("scale by amax * fp32(1/6) (E4M3 code mismatches):", mul)
    ok = all(v == (0, 0) for v in got.values()) and any(sum(v) for v in ctrl.values())
    bs, bs_ctrl = check_cmp_bsearch(), check_cmp_bsearch(ties_wrong=True)
    print("binary-search codes of general fp32 values (code mismatches; control must be > 0):", bs, bs_ctrl)
    ok = ok and not any(scaled.values()) and not any(mul.values()) and bs == 0 and bs_ctrl > 0
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)
