"""Seeded fuzz of every family against its simulator and against float64 exact attention.

The hand-picked grids of test_int8.py and test_fp4_attn.py cover the shapes someone thought of; these cases are
drawn, so they also reach combinations nobody listed: B 1-3; Hkv 1-3 with GQA ratios 1-4; Nq and Nk from 1 to 520,
half of them beside a tile or block size of some kernel (16, 64, 128, 192 rows or keys), with Nq = 1, Nk = 1 and
Nq = Nk forced into every block of 8 cases; D 64 or 128; fp16 or bf16; HND or NHD; causal or not; the mma.sync or the
wgmma engine (wgmma cases skip off sm_90); sigma; the family's configs; and inputs that are contiguous, views into a
larger buffer (extra batches, heads and tokens, rows 8 elements longer than D: strided, read in place) or such views
with rows off 16 bytes (copied by the entry points). The rest of a view's buffer is NaN, so a kernel that reads
outside the view, or writes into the caller's memory, fails the case.

Every check and tolerance is the existing suite's, called through its helpers (test_int8._check, the LSE bounds of
test_int8._run_case, test_fp4_attn._check / _check_lse / _ambiguous_rows / TOL_GRAD). Two degenerate cases that the
hand-picked grids never reach are routed to the simulator comparison alone, with its own bound (_check_degenerate):
an exact gradient that is identically zero (every row sees at most one key) where the kernel's values reach the 1e-3
that test_int8._check allows (with per-block V the simulator carries the same quantization noise: O = V^, not V, so
dP - delta is not 0); and a simulator that equals exact attention (QAT's dV with one key: P = fq_P(P) = 1), where
the exact comparison's 1.1 x 0 + 1e-4 has no room for the rounding of the output to bf16 (~2e-3) that the
simulator bound includes.

Two more INT8 families draw what the first one does not: ``int8w`` the same cases with a sliding window (sides on and
off the tile edges, narrower than a tile, unbounded, or drawn; causal ones with right = 0), checked as
test_int8_window checks; ``int8p`` packed sequences (layout "THD": 1-4 sequences of drawn lengths, a sixth of them
empty in q, k or both, causal or not, sometimes a window), checked as test_int8_varlen checks.

FUZZ_SEED fixes the draws; each family draws from its own stream (numpy's default_rng([FUZZ_SEED, family])), so a
larger count appends cases and keeps the earlier ones. The first QUICK_CASES of each family run by default; the rest,
up to FULL_CASES, carry the `slow` marker and run only when the -m expression names it::

    pytest tests/gpu/test_fuzz.py                     # the quick subset
    pytest tests/gpu/test_fuzz.py -m "gpu or slow"    # all FULL_CASES of each family
    bash bench/fuzz.sh 3400                           # long runs: 3400 cases per family, all cores

A failing case prints its parameters and the command that reruns it alone.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sagecupy.config import BKV64, DEFAULT, PAPER, NVFP4Config, QATConfig
from sagecupy.reference import attention as ref_attn
from sagecupy.reference import metrics

# Helpers, checks and tolerances of the existing suite (same folder).
import test_fp4_attn as tf  # noqa: E402
import test_int8 as t8  # noqa: E402

pytestmark = pytest.mark.gpu

FUZZ_SEED = 20250611
QUICK_CASES = 8   # per family, by default
FULL_CASES = 64   # per family with -m slow (the quick ones included)

# int8w: the INT8 kernels with sliding windows; int8p: packed sequences (layout "THD"). Each family has its own stream,
# so the later ones leave the earlier families' cases as they were.
FAMILIES = ("int8", "nvfp4", "qat", "int8w", "int8p")
INT8_CONFIGS = {"default": DEFAULT, "paper": PAPER, "bkv64": BKV64}
NV_CONFIGS = {"two-level": NVFP4Config(), "single-level": NVFP4Config(two_level_p=False),
              "no-smoothing": NVFP4Config(k_smoothing=False)}
# Lengths one off (or a few off) the kernels' tiles and blocks: 16-element FP4 blocks, 64-row backward tiles and
# 64-key tiles, 128-row forward blocks and 128-key tiles, 192-row warp-specialized NVFP4 blocks, 256-token statistics
# chunks; 449 and 513 reach 8 key tiles, where the NVFP4 tail split starts.
LENGTHS = (2, 3, 15, 17, 31, 33, 63, 65, 95, 127, 129, 191, 193, 255, 257, 300, 383, 449, 513)
MAX_LEN = 520
# B * Hq * Nq * Nk at most: the float64 simulators hold (Nq, Nk) matrices per head (about 0.3 s per case at this
# size on a 2-core CPU), and the kernels' time is negligible beside them.
MAX_WORK = 1_500_000
SIGMAS = {"int8": (1.0, 1.0, 2.0, 4.0), "nvfp4": (1.0, 1.0, 2.0, 4.0),
          # QAT: the sigmas of test_qat_backward_vs_reference and a step above (5 and 10 are tested forward only)
          "qat": (1.0, 1.0, 2.0), "int8w": (1.0, 1.0, 2.0, 4.0), "int8p": (1.0, 1.0, 2.0, 4.0)}


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    index: int
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    dtype: str
    layout: str
    causal: bool
    engine: str
    memory: str   # "contiguous", "view" (strided, read in place) or "copied" (rows off 16 bytes: copied)
    sigma: float
    config: str
    seed: int
    window: tuple = None  # (left, right) (int8w, int8p)
    docs: tuple = None    # int8p: (Nq, Nk) of each packed sequence

    @property
    def id(self):
        return f"{self.family}-{self.index:03d}"

    def describe(self):
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return (f"fuzz case {self.id} (FUZZ_SEED={FUZZ_SEED}): {fields}\n  rerun: python3 -m pytest "
                f"'tests/gpu/test_fuzz.py::test_{self.family}_fuzz[{self.id}]' -m 'gpu or slow'")


def _block(rng, values, n=8):
    """n draws of ``values`` repeated evenly, in random order: every block of cases balances each factor."""
    return list(rng.permutation(np.resize(np.asarray(values, dtype=object), n)))


def _length(rng):
    return int(rng.choice(LENGTHS)) if rng.random() < 0.55 else int(rng.integers(1, MAX_LEN + 1))


# Window sides: a tile edge and one off it (64/128-key tiles), narrower than a tile, unbounded (-1), or drawn.
WINDOW_SIDES = (-1, 0, 1, 5, 17, 63, 64, 127, 128, 129, 300)


def _window(rng, causal):
    side = lambda: int(rng.choice(WINDOW_SIDES)) if rng.random() < 0.7 else int(rng.integers(0, MAX_LEN))  # noqa: E731
    left, right = side(), (0 if causal else side())
    return (left, right)


def _draw_packed(rng, n):
    """int8p: 1-4 sequences of drawn lengths (a sixth of them empty in q, k or both), within MAX_WORK."""
    cases = []
    while len(cases) < n:
        docs = []
        for _ in range(int(rng.integers(1, 5))):
            nq, nk = (0 if rng.random() < 1 / 6 else _length(rng) for _ in range(2))
            docs.append((nq, nk))
        Hkv, ratio = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        while Hkv * ratio * sum(a * b for a, b in docs) > MAX_WORK:
            if Hkv > 1:
                Hkv -= 1
            elif ratio > 1:
                ratio -= 1
            else:
                docs = [(a // 2, b // 2) for a, b in docs]
        if not sum(a for a, _ in docs) or not sum(b for _, b in docs):  # (a call has at least one query and one key)
            docs[0] = (max(docs[0][0], 1), max(docs[0][1], 1))
        causal = bool(rng.random() < 0.5)
        window = _window(rng, causal) if rng.random() < 0.4 else None
        config = str(rng.choice(list(INT8_CONFIGS)))
        D, dtype = int(rng.choice((64, 128))), str(rng.choice(("float16", "bfloat16")))
        engine, sigma = str(rng.choice(("mma", "wgmma"))), float(rng.choice(SIGMAS["int8"]))
        seed = int(rng.integers(2 ** 31))
        cases.append(Case("int8p", len(cases), 1, Hkv * ratio, Hkv, sum(a for a, _ in docs), sum(b for _, b in docs),
                          D, dtype, "THD", causal, engine, "contiguous", sigma, config, seed, window, tuple(docs)))
    return cases


def draw_cases(family: str, n: int = FULL_CASES) -> list:
    """The first ``n`` cases of ``family``: a pure function of FUZZ_SEED (no device needed)."""
    rng = np.random.default_rng([FUZZ_SEED, FAMILIES.index(family)])
    if family == "int8p":
        return _draw_packed(rng, n)
    cases = []
    while len(cases) < n:
        cols = {"dtype": _block(rng, ("float16", "bfloat16")), "layout": _block(rng, ("HND", "NHD")),
                "causal": _block(rng, (False, True)), "engine": _block(rng, ("mma", "wgmma")),
                "D": _block(rng, (64, 128)), "memory": _block(rng, ("contiguous", "view", "view", "copied"))}
        special = rng.permutation(8)[:3]  # positions given Nq = 1, Nk = 1 and Nq = Nk
        for j in range(8):
            nq, nk = _length(rng), _length(rng)
            while nk == nq:
                nk = _length(rng)
            if j == special[0]:
                nq = 1
            elif j == special[1]:
                nk = 1
            elif j == special[2]:
                nk = nq
            B, Hkv, ratio = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
            while B * Hkv * ratio * nq * nk > MAX_WORK:  # fewer batches, then kv heads, then query heads per kv head
                if B > 1:
                    B -= 1
                elif Hkv > 1:
                    Hkv -= 1
                elif ratio > 1:
                    ratio -= 1
                else:
                    nq, nk = max(1, nq // 2), max(1, nk // 2)
            if family in ("int8", "int8w"):
                config = str(rng.choice(list(INT8_CONFIGS)))
            elif family == "nvfp4":
                config = str(rng.choice(list(NV_CONFIGS)))
            else:
                config = "default"
            sigma = float(rng.choice(SIGMAS[family]))
            seed = int(rng.integers(2 ** 31))
            causal = bool(cols["causal"][j])
            window = _window(rng, causal) if family == "int8w" else None
            cases.append(Case(family, len(cases), B, Hkv * ratio, Hkv, nq, nk, int(cols["D"][j]), str(cols["dtype"][j]),
                              str(cols["layout"][j]), causal, str(cols["engine"][j]),
                              str(cols["memory"][j]), sigma, config, seed, window))
    return cases[:n]


def _params(family, n=FULL_CASES):
    return [pytest.param(c, id=c.id, marks=() if c.index < QUICK_CASES else pytest.mark.slow)
            for c in draw_cases(family, n)]


def pytest_generate_tests(metafunc):
    """The cases of each family: FULL_CASES, or --fuzz-cases N (the long runs of bench/fuzz.sh: the first FULL_CASES
    are the same cases, since each family draws from its own seeded stream)."""
    family = {"test_int8_fuzz": "int8", "test_nvfp4_fuzz": "nvfp4", "test_qat_fuzz": "qat", "test_int8w_fuzz": "int8w",
              "test_int8p_fuzz": "int8p"}.get(metafunc.function.__name__)
    if family is not None:
        n = metafunc.config.getoption("--fuzz-cases")
        if n is not None and n < 1:
            raise pytest.UsageError(f"--fuzz-cases must be at least 1, got {n}")
        n = n or FULL_CASES
        metafunc.parametrize("fuzz_case", _params(family, n), indirect=True)


def _full_run(config) -> bool:
    """Whether -m names the slow marker (other than as 'not slow')."""
    expr = config.getoption("markexpr", "") or ""
    return "slow" in expr.replace("not slow", "")


@pytest.fixture
def fuzz_case(request):
    """The case, after the skips: slow cases without -m slow, wgmma cases off sm_90. A failure prints the case."""
    case = request.param
    if request.node.get_closest_marker("slow") and not _full_run(request.config):
        pytest.skip(f"fuzz case {case.id} is past QUICK_CASES={QUICK_CASES}: run with -m 'gpu or slow'")
    if case.engine == "wgmma":
        from sagecupy._loader import device_capability

        if device_capability() != (9, 0):
            pytest.skip("the wgmma engine needs sm_90")
    yield case


# ----------------------------------------------------------------------------------------------------- inputs


def _place(x, memory):
    """``x`` (a device array from test_int8._inputs) as the case's memory asks: itself, or its values in a view of a
    larger NaN-filled buffer: one more batch, two more heads and three more tokens around it (in the layout's axis
    order) and rows of D + 8 elements, starting at element 0 of a row ("view": rows 16-byte aligned, so the kernels
    read the view in place through its strides) or at element 2 ("copied": rows 4 bytes off 16, so the entry points
    copy it first). Returns ``(array, buffer)``; the buffer is None for contiguous inputs."""
    if memory == "contiguous":
        return x, None
    cp = t8._cupy()
    raw = t8._raw(x)
    B, a1, a2, D = raw.shape
    off = 0 if memory == "view" else 2
    buf = cp.empty((B + 1, a1 + 2, a2 + 3, D + 8), dtype=raw.dtype)
    buf.fill(cp.nan if raw.dtype == cp.float16 else 0x7FC0)  # (bf16 bits: a NaN pattern)
    view = buf[1:1 + B, 2:2 + a1, 3:3 + a2, off:off + D]
    view[...] = raw
    # (one row, B = a1 = a2 = 1, has no row stride to exercise: CuPy calls any single-row view contiguous)
    assert not view.flags.c_contiguous or B * a1 * a2 == 1
    assert (view.data.ptr % 16 == 0) == (memory == "view")
    if raw.dtype == cp.uint16:
        from sagecupy.adapters.bf16 import BF16Array

        view = BF16Array(view)
    return view, buf


def _inputs(c):
    """Device inputs (placed as the case asks), their exact values on the host, and the buffers to check after."""
    dev, host = t8._inputs(c.seed, c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, c.layout, c.dtype, c.sigma)
    placed = [_place(x, c.memory) for x in dev]
    return [p[0] for p in placed], host, _snapshot([p[0] for p in placed], [p[1] for p in placed])


def _snapshot(arrays, buffers):
    """Bits of every input and of its whole buffer: the calls must change neither (the NaN around a view included)."""
    whole = [t8._raw(a) if b is None else b for a, b in zip(arrays, buffers)]
    return [(w, w.copy()) for w in whole]


def _assert_untouched(snap, c):
    cp = t8._cupy()
    for i, (w, before) in enumerate(snap):
        bits = cp.uint16 if w.dtype.itemsize == 2 else w.dtype
        assert bool((w.view(bits) == before.view(bits)).all()), f"input {i} or its buffer was modified\n{c.describe()}"


def _replace_do(do_dev, c):
    """dO placed as the case asks (after the QAT test's zeroing of ambiguous rows)."""
    return _place(do_dev, c.memory)


# ------------------------------------------------------------------------------------------------------ checks


def _check_degenerate(check, name, got, sim, exact, dtype, case, **kw):
    """``check`` (an existing helper), except in two degenerate cases. An exact gradient that is identically zero:
    the kernel's values below 1e-3 pass (test_int8._check's rule for it), larger ones are compared with the simulator
    (which carries the quantization noise the format adds to a zero gradient). A simulator that equals exact attention:
    compared with the simulator, whose bound is then the comparison with exact attention with room for the output's
    rounding. Both simulator comparisons take the helper's own bound: its tolerance plus the output format's rounding
    of the simulator's result."""
    zero = not np.any(exact)
    if zero and np.abs(got).max() < 1e-3:
        assert np.isfinite(got).all(), f"{name}: non-finite output {case}"
        return
    if zero or metrics.rel_l2(sim, exact) <= 1e-12:
        tol = kw.get("tol", None)
        bound = (t8.TOL[name] if tol is None else tol) + metrics.rel_l2(t8._round_to(sim, dtype), sim)
        err = metrics.rel_l2(got, sim)
        assert np.isfinite(got).all(), f"{name}: non-finite output {case}"
        why = "exact gradient 0" if zero else "simulator = exact attention"
        assert err <= bound, (f"{name}: {why}: rel_l2 vs simulator {err:.3e} > {bound:.3e} {case}; "
                              f"worst {metrics.worst_element(got, sim)}")
        return
    check(name, got, sim, exact, dtype, case, **kw)


def _check_int8_lse(lse_h, lse_sim, case):
    """test_int8._run_case's LSE check, as it is there."""
    fin = np.isfinite(lse_sim)
    assert np.array_equal(np.isfinite(lse_h), fin), f"LSE -inf pattern differs {case}"
    d_lse = np.abs(lse_h[fin] - lse_sim[fin])
    if d_lse.size:
        assert np.quantile(d_lse, 0.99) < 1e-4 and d_lse.max() < 1e-2, (
            f"LSE vs simulator: p99 {np.quantile(d_lse, 0.99):.2e}, max {d_lse.max():.2e} {case}")


# ------------------------------------------------------------------------------------------------- the families


def run_int8(c):
    import sagecupy.int8 as s8
    from sagecupy.reference import sagebwd as ref_sage

    cfg = INT8_CONFIGS[c.config]
    case = c.describe()
    (q, k, v, do), (qh, kh, vh, doh), snap = _inputs(c)
    o, lse, res = s8.forward(q, k, v, causal=c.causal, layout=c.layout, config=cfg, return_lse=True, engine=c.engine)
    o_h = t8._to_host(o)
    o_sim, r_sim = ref_sage.forward(qh, kh, vh, causal=c.causal, layout=c.layout, config=cfg, dtype=c.dtype)
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh, causal=c.causal, layout=c.layout)
    t8._check("O", o_h, o_sim, o_ex, c.dtype, case)
    _check_int8_lse(lse.get().astype(np.float64), r_sim["lse"], case)
    dq, dk, dv = s8.backward(res, do, engine=c.engine)
    r_sim = dict(r_sim, o=ref_attn.to_hnd(o_h, c.layout))  # the kernel's delta uses its own (rounded) O
    sims = ref_sage.backward(r_sim, doh)
    exact = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=c.causal, layout=c.layout)
    for name, got, sim, ex in zip(("dQ", "dK", "dV"), (dq, dk, dv), sims, exact):
        _check_degenerate(t8._check, name, t8._to_host(got), sim, ex, c.dtype, case)
    _assert_untouched(snap, c)


def run_nvfp4(c):
    from sagecupy import nvfp4
    from sagecupy.reference import nvfp4 as ref_nv

    cfg = NV_CONFIGS[c.config]
    case = c.describe()
    (q, k, v, _), (qh, kh, vh, _), snap = _inputs(c)
    o, lse = nvfp4.attention(q, k, v, causal=c.causal, layout=c.layout, config=cfg, return_lse=True, engine=c.engine)
    o_sim, lse_sim, inter = ref_nv.forward(qh, kh, vh, causal=c.causal, layout=c.layout, config=cfg,
                                           return_intermediates=True)
    o_ex, _ = ref_attn.attention_forward(qh, kh, vh, causal=c.causal, layout=c.layout)
    amb = tf._ambiguous_rows(inter["S"], cfg.two_level_p)
    tf._check("O", tf._host(o), o_sim, o_ex, c.dtype, case, ambiguous=amb, layout=c.layout)
    tf._check_lse(lse.get().astype(np.float64), lse_sim, case)
    _assert_untouched(snap, c)


def run_qat(c):
    from sagecupy import qat
    from sagecupy.reference import qat as ref_qat

    case = c.describe()
    (q, k, v, do), (qh, kh, vh, doh), snap = _inputs(c)
    o, lse, res = qat.forward(q, k, v, causal=c.causal, layout=c.layout, config=QATConfig(), return_lse=True,
                              engine=c.engine)
    o_sim, r_sim, inter = ref_qat.forward(qh, kh, vh, causal=c.causal, layout=c.layout, return_intermediates=True)
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh, causal=c.causal, layout=c.layout)
    amb = tf._ambiguous_rows(inter["S"], True)
    tf._check("O", tf._host(o), o_sim, o_ex, c.dtype, case, ambiguous=amb, layout=c.layout)
    tf._check_lse(lse.get().astype(np.float64), r_sim["lse"], case)
    # as test_fp4_attn._qat_fwd_case: O' against the simulator's P V~, and the saved operands exactly the reference's
    tf._check("O'", res.o_prime.get()[:, :, :c.Nq].astype(np.float64), r_sim["o_prime"], None, "float16", case)
    np.testing.assert_array_equal(tf._fq_host(res.q_t)[:, :, :c.Nq], r_sim["q_t"], err_msg=case)
    np.testing.assert_array_equal(tf._fq_host(res.k_t)[:, :, :c.Nk], r_sim["k_t"], err_msg=case)
    np.testing.assert_array_equal(np.swapaxes(tf._fq_host(res.vt_t)[..., :c.Nk], -1, -2), r_sim["v_t"], err_msg=case)
    # as test_qat_backward_vs_reference: rows whose P quantization is ambiguous in fp32 get dO = 0 on both sides
    if amb.any():
        doh = doh * ref_attn.from_hnd((~amb)[..., None].astype(np.float64), c.layout)
        do, buf = _replace_do(t8._to_dev(doh, c.dtype), c)
        snap = snap + _snapshot([do], [buf])
    dq, dk, dv = qat.backward(res, do, engine=c.engine)
    sims = ref_qat.backward(r_sim, doh)
    exact = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=c.causal, layout=c.layout)
    for name, got, sim, ex in zip(("dQ", "dK", "dV"), (dq, dk, dv), sims, exact):
        got = tf._host(got)
        if not np.any(sim):  # as test_qat_backward_vs_reference
            assert np.abs(got).max() < 1e-3, f"{name}: reference gradient is 0 {case}"
            continue
        _check_degenerate(tf._check, name, got, sim, ex, c.dtype, case, tol=tf.TOL_GRAD)
    _assert_untouched(snap, c)


def run_int8w(c):
    """test_int8_window's comparisons (simulator and exact attention with the window, the zero-gradient routing of
    _check_degenerate, rows that see no key, inputs untouched)."""
    import test_int8_window as tw

    tw._run_window_case(c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, c.causal, c.window, c.layout, c.dtype,
                        INT8_CONFIGS[c.config], c.engine, seed=c.seed)


def run_int8p(c):
    """test_int8_varlen's comparisons (per-sequence statistics in the simulator, rows and keys no one sees, inputs
    untouched), the gradients through _check_degenerate."""
    import test_int8_varlen as tv

    tv._run(list(c.docs), c.Hq, c.Hkv, c.D, c.dtype, c.causal, c.window, INT8_CONFIGS[c.config], c.engine, seed=c.seed,
            check_grad=lambda *a: _check_degenerate(t8._check, *a))


RUNNERS = {"int8": run_int8, "nvfp4": run_nvfp4, "qat": run_qat, "int8w": run_int8w, "int8p": run_int8p}


def _run(case):
    try:
        RUNNERS[case.family](case)
    except BaseException:
        print(case.describe())
        raise


def test_int8_fuzz(fuzz_case):
    _run(fuzz_case)


def test_nvfp4_fuzz(fuzz_case):
    _run(fuzz_case)


def test_qat_fuzz(fuzz_case):
    _run(fuzz_case)


def test_int8w_fuzz(fuzz_case):
    _run(fuzz_case)


def test_int8p_fuzz(fuzz_case):
    _run(fuzz_case)
