"""Packed variable-length sequences (``layout="THD"``, docs/algorithms.md §1.8) on the INT8 host paths without a GPU
(the stand-in cupy of test_host_paths): validation on every entry point, naming the argument; the launches a packed
forward and backward record (grids sized by the host's bounds, the per-call offsets passed as arrays, never read
back); the residuals' checks; and the table the packed pre-pass computes on the device, modelled in NumPy
(``_varlen.reference_meta``), against the sequences it stands for."""
import dataclasses
import sys

import numpy as np
import pytest

from sagecupy.config import DEFAULT
from test_host_paths import FakeArray, gpu  # noqa: F401  (gpu: the fixture)

S_LENS = ((100, 70), (0, 5), (129, 0), (1, 1))  # (Nq, Nk) per sequence: an empty q, an empty k
TQ, TK = sum(a for a, _ in S_LENS), sum(b for _, b in S_LENS)


@pytest.fixture(autouse=True)
def _fresh_plans():
    from sagecupy import int8

    for plans in (int8._FWD_PLANS, int8._BWD_PLANS):
        plans.clear()


def _packed(hq=4, hkv=2, d=64, dtype=np.float16, tq=TQ, tk=TK, s=len(S_LENS)):
    q, k, v = FakeArray((tq, hq, d), dtype), FakeArray((tk, hkv, d), dtype), FakeArray((tk, hkv, d), dtype)
    cu_q, cu_k = FakeArray((s + 1,), np.int32), FakeArray((s + 1,), np.int32)
    return q, k, v, dict(layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _host_offsets():
    return (np.concatenate([[0], np.cumsum([a for a, _ in S_LENS])]).astype(np.int32),
            np.concatenate([[0], np.cumsum([b for _, b in S_LENS])]).astype(np.int32))


def _calls(q, k, v, kw):
    from sagecupy import int8

    return ((lambda: int8.forward(q, k, v, **kw)), (lambda: int8.sage_attention(q, k, v, **kw)))


# ---- validation ----

def _bad_cases():
    q, k, v, kw = _packed()
    cq, ck = _host_offsets()
    dense = FakeArray((1, 4, TQ, 64), np.float16)
    return [
        # (q, k, v, keywords, exception, words)
        (q, k, v, dict(layout="THD"), ValueError, "cu_seqlens_q is required with layout='THD'"),
        (q, k, v, dict(kw, cu_seqlens_k=None), ValueError, "cu_seqlens_k is required"),
        (dense, dense, dense, dict(cu_seqlens_q=kw["cu_seqlens_q"]), ValueError,
         r"cu_seqlens_q is only for layout='THD' \(packed sequences\), got layout='HND'"),
        (dense, dense, dense, dict(layout="NHD", max_seqlen_k=4), ValueError, "max_seqlen_k is only for layout='THD'"),
        (q, k, v, dict(kw, cu_seqlens_q=FakeArray((5,), np.int64)), TypeError,
         r"cu_seqlens_q\.dtype=int64 must be int32"),
        (q, k, v, dict(kw, cu_seqlens_k=FakeArray((5,), np.float32)), TypeError, r"cu_seqlens_k\.dtype=float32"),
        (q, k, v, dict(kw, cu_seqlens_q=FakeArray((5, 1), np.int32)), ValueError, r"cu_seqlens_q must be 1-D"),
        (q, k, v, dict(kw, cu_seqlens_q=FakeArray((1,), np.int32), cu_seqlens_k=FakeArray((1,), np.int32)),
         ValueError, r"cu_seqlens_q must hold S \+ 1 >= 2 offsets"),
        (q, k, v, dict(kw, cu_seqlens_k=FakeArray((4,), np.int32)), ValueError,
         r"cu_seqlens_q and cu_seqlens_k must have the same length \(S \+ 1\), got 5 and 4"),
        (q, k, v, dict(kw, cu_seqlens_q="0,1"), TypeError, "cu_seqlens_q must be a CuPy int32 array"),
        (q, k, v, dict(kw, max_seqlen_q=3.5), ValueError, r"max_seqlen_q=3\.5 must be a non-negative integer"),
        (q, k, v, dict(kw, max_seqlen_k=True), ValueError, "max_seqlen_k=True"),
        (q, k, v, dict(kw, max_seqlen_k=-1), ValueError, "max_seqlen_k=-1"),
        (dense, k, v, kw, ValueError, r"q must be 3-D \(total, H, D\) for layout='THD'"),
        (q, k, FakeArray((TK, 2, 128), np.float16), kw, ValueError, "k and v must have the same shape"),
        (q, FakeArray((TK, 3, 64), np.float16), FakeArray((TK, 3, 64), np.float16), kw, ValueError, "heads"),
        (FakeArray((TQ, 4, 32), np.float16), k, v, kw, ValueError, "head_dim=32"),
        (FakeArray((TQ, 0, 64), np.float16), k, v, kw, ValueError, "zero-size dimension H=0"),
        (FakeArray((TQ, 4, 64), np.float32), k, v, kw, TypeError, r"q\.dtype=float32"),
        (q, k, v, dict(kw, causal=1), TypeError, "causal must be a bool"),
        (q, k, v, dict(kw, causal=True, window=(3, 2)), ValueError, "causal=True contradicts window"),
        (q, k, v, dict(kw, sm_scale=-1.0), ValueError, "sm_scale"),
        # host offsets: checked in full, as the reference checks them
        (q, k, v, dict(kw, cu_seqlens_q=cq[::-1].copy(), cu_seqlens_k=ck), ValueError, "cu_seqlens_q must start at 0"),
        (q, k, v, dict(kw, cu_seqlens_q=cq, cu_seqlens_k=np.array([0, 70, 60, 75, 76])), ValueError,
         r"cu_seqlens_k must be non-decreasing"),
        (q, k, v, dict(kw, cu_seqlens_q=cq + np.array([0, 0, 0, 0, 1]), cu_seqlens_k=ck), ValueError,
         f"cu_seqlens_q must end at the packed length {TQ}"),
        (q, k, v, dict(kw, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=128), ValueError,
         r"max_seqlen_q=128 is less than the longest sequence \(129\)"),
        (q, k, v, dict(kw, cu_seqlens_q=cq.astype(np.float64), cu_seqlens_k=ck), ValueError,
         "cu_seqlens_q must be a 1-D integer array"),
        (q, k, v, dict(kw, cu_seqlens_q=[0, 100, 100], cu_seqlens_k=ck), ValueError,
         "cu_seqlens_q and cu_seqlens_k must have the same length"),
        (q, k, v, dict(kw, cu_seqlens_q=cq), TypeError, "must both be device arrays or both host arrays, got a host"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_arguments_are_refused_naming_them(gpu, case):
    from sagecupy import int8

    q, k, v, kw, exc, words = _bad_cases()[case]
    for call in _calls(q, k, v, kw):
        with pytest.raises(exc, match=words):
            call()
    ok, why = int8.is_supported(q, k, v, **kw)
    assert not ok and why
    assert gpu == []  # refused before any launch


def test_good_arguments_are_supported(gpu):
    from sagecupy import int8

    q, k, v, kw = _packed()
    cq, ck = _host_offsets()
    assert int8.is_supported(q, k, v, **kw) == (True, "")
    assert int8.is_supported(q, k, v, **dict(kw, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=129,
                                             max_seqlen_k=70)) == (True, "")
    assert int8.is_supported(q, k, v, **dict(kw, cu_seqlens_q=list(cq), cu_seqlens_k=tuple(ck))) == (True, "")
    # device offsets: max_seqlen is not compared with them (that would read them back)
    assert int8.is_supported(q, k, v, **dict(kw, max_seqlen_q=1, max_seqlen_k=0)) == (True, "")
    assert gpu == []


# ---- launches ----

def _names(launches):
    return [x[0].split("<")[0] for x in launches]


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
@pytest.mark.parametrize("d", [64, 128])
def test_forward_launches(gpu, engine, d):
    """The table's two kernels first (the offsets passed as the caller's arrays with their strides), grids sized by
    the host's bounds (_checks.packed_bounds), the table and S passed to every later kernel."""
    from sagecupy import _checks, _varlen, int8

    q, k, v, kw = _packed(d=d)
    S = len(S_LENS)
    tq_pad, tk_pad, nbq, nbk, nchk = _checks.packed_bounds(S, TQ, TK)
    assert (tq_pad, tk_pad) == (768, 640) and (nbq, nbk, nchk) == (12, 10, 5)
    for rep in range(2):  # recorded, then replayed with other offsets arrays
        kw = dict(kw, cu_seqlens_q=FakeArray((S + 1,), np.int32), cu_seqlens_k=FakeArray((S + 1,), np.int32))
        start, fills = len(gpu), len(FakeArray.fills)
        o, lse, res = int8.forward(q, k, v, engine=engine, return_lse=True, **kw)
        launches = gpu[start:]
        # the residuals' rows past H * total are cleared (their padded blocks end by an unknown row in between)
        cleared = {ptr: (shape, value) for ptr, shape, value in FakeArray.fills[fills:]}
        for x, h, n in ((res.q_codes, 4, TQ), (res.q_scale, 4, TQ), (res.k_codes, 2, TK), (res.k_scale, 2, TK),
                        (res.lse2, 4, TQ)):
            assert cleared[x.data.ptr + h * n * x.strides[0]] == ((x.shape[0] - h * n,) + x.shape[1:], 0), x.shape
        assert o.shape == (TQ, 4, d) and lse.shape == (4, TQ) and o.dtype == np.float16
        wgmma_qkv = engine == "wgmma" and d == 128
        assert _names(launches) == (["packed_offsets", "packed_tables", "column_partial_kv_packed",
                                     "column_finish_kv_packed"]
                                    + (["quant_qkv_packed"] if wgmma_qkv else ["quant_rows_qk_packed"])
                                    + ([] if wgmma_qkv else ["fwd_v_image_packed" if engine == "wgmma"
                                                              else "quant_transpose_perm_packed"])
                                    + ["int8_attn_fwd_sm90_packed" if engine == "wgmma" else "int8_attn_fwd_packed"])
        offs, tables = launches[0], launches[1]
        assert offs[1:3] == ((1, 1, 1), (1024, 1, 1)) or (offs[1], offs[2]) == ((1,), (1024,))
        a = offs[3]
        assert a[0] is kw["cu_seqlens_q"] and a[2] is kw["cu_seqlens_k"]
        assert [int(x) for x in (a[1], a[3], a[4], a[5], a[6])] == [1, 1, S, TQ, TK]
        meta = a[7]
        assert meta is res.packed and meta.shape == (_varlen.meta_size(res.problem),) and meta.dtype == np.int32
        assert tables[1] == (-(-(nbq + nbk + nchk) // 256),)
        assert [int(x) for x in tables[3][1:]] == [S, nbq, nbk, nchk]
        by = {n.split("<")[0]: x for n, x in ((x[0], x) for x in launches)}
        assert by["column_partial_kv_packed"][1] == (nchk, 2, 2)
        assert by["column_finish_kv_packed"][1] == (2 * S * 2,)
        rows = by["quant_qkv_packed" if wgmma_qkv else "quant_rows_qk_packed"]
        assert rows[1] == (max(nbq, nbk), 4 + (4 if wgmma_qkv else 2), 1)
        attn = launches[-1]
        assert attn[1] == (nbq, 4, 1) and attn[2] == (128,)
        assert attn[3][-3] is meta and [int(x) for x in attn[3][-2:]] == [S, TQ]
        for launch in launches[2:]:  # every later kernel reads the table
            assert any(x is meta for x in launch[3]), launch[0]
        assert res.problem.layout == "THD" and (res.problem.batch, res.problem.nq, res.problem.nk) == (S, TQ, TK)
        assert res.q_codes.shape == (4 * tq_pad, d) and res.k_codes.shape == (2 * tk_pad, d)
        assert res.lse2.shape == (4 * tq_pad,) and res.mu_k.shape == (S, 2, d)


# Per backward mode: the config, the kernels' (DV16, DS16) template arguments, and the dO pre-pass on the wgmma and
# the mma.sync engine (16-bit dQ and dK read no dO codes on wgmma; dO's codes are per channel (1) or per block (2),
# do_granularity).
# mode: config, DV16, DS16, the wgmma pre-passes' dO pass, the mma.sync pre-passes (dO's codes for an INT8 dV only,
# else delta alone; Q's and K's transposes for INT8 dK and dQ only)
BWD_MODES = {
    "default": ("default", "true", "true", "bwd_do16_image_packed<__half, 128>", ["bwd_delta_packed<__half, 128>"]),
    "default-ds8": (DEFAULT.replace(name="default-ds8", ds_int8=True), "true", "false",
                    "bwd_do_image_packed<__half, 128, 1>",
                    ["bwd_delta_packed<__half, 128>", "transpose_i8_qk_packed<128, true>"]),
    "paper": ("paper", "false", "false", "bwd_do_image_packed<__half, 128, 2>",
              ["quant_transpose_perm_delta_packed<__half, 128, 2>", "transpose_i8_qk_packed<128, true>"]),
}


@pytest.mark.parametrize("mode", list(BWD_MODES))
@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_backward_launches(gpu, engine, mode):
    from sagecupy import _checks, int8

    config, dv16, ds16, do_wgmma, do_mma = BWD_MODES[mode]
    q, k, v, kw = _packed(d=128)
    S = len(S_LENS)
    _, _, nbq, nbk, _ = _checks.packed_bounds(S, TQ, TK)
    o, res = int8.forward(q, k, v, engine=engine, config=config, **kw)
    do = FakeArray(q.shape, q.dtype)
    for _ in range(2):
        start = len(gpu)
        dq, dk, dv = int8.backward(res, do, engine=engine)
        launches = gpu[start:]
        assert dq.shape == (TQ, 4, 128) and dk.shape == dv.shape == (TK, 2, 128)
        sfx = "_sm90" if engine == "wgmma" else ""
        pre = ([f"bwd_qk_images_packed<__half, 128, {ds16}>", do_wgmma] if engine == "wgmma"
               else do_mma)
        assert [x[0] for x in launches] == pre + [f"int8_attn_bwd{sfx}_packed<__half, 128, {dv16}, {ds16}>",
                                                  f"int8_attn_bwd_dq{sfx}_packed<__half, 128, {ds16}>"]
        for launch in launches:
            assert any(x is res.packed for x in launch[3]), launch[0]
        dkdv, dqk = launches[-2:]
        assert dkdv[1] == (nbk, 2, 1) and dqk[1] == (nbq, 4, 1)
        assert [int(x) for x in dkdv[3][-2:]] == [S, nbq] and int(dqk[3][-1]) == S


def test_host_offsets_are_checked_and_copied_per_call(gpu, monkeypatch):
    """NumPy offsets: checked against the call's totals on every call (the plan is shared), then copied."""
    from sagecupy import int8

    copies = []

    def asarray(x):
        copies.append(np.array(x))
        return FakeArray(np.shape(x), np.int32)

    monkeypatch.setattr(sys.modules["cupy"], "asarray", asarray, raising=False)
    q, k, v, kw = _packed()
    cq, ck = _host_offsets()
    kw = dict(kw, cu_seqlens_q=cq, cu_seqlens_k=ck)
    int8.forward(q, k, v, **kw)
    int8.forward(q, k, v, **kw)
    assert len(copies) == 4 and all(c.dtype == np.int32 for c in copies)
    np.testing.assert_array_equal(copies[2], cq)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        int8.forward(q, k, v, **dict(kw, cu_seqlens_k=np.array([0, 70, 60, 75, 76])))  # the same plan's signature


def test_max_seqlen_is_checked_per_call_and_shares_the_plan(gpu, monkeypatch):
    from sagecupy import int8

    monkeypatch.setattr(sys.modules["cupy"], "asarray", lambda x: FakeArray(np.shape(x), np.int32), raising=False)
    q, k, v, kw = _packed()
    int8.forward(q, k, v, **dict(kw, max_seqlen_q=129, max_seqlen_k=70))
    n_plans = len(int8._FWD_PLANS)
    int8.forward(q, k, v, **dict(kw, max_seqlen_q=200, max_seqlen_k=None))
    assert len(int8._FWD_PLANS) == n_plans  # the same program
    with pytest.raises(ValueError, match="max_seqlen_q=-3"):
        int8.forward(q, k, v, **dict(kw, max_seqlen_q=-3))
    cq, ck = _host_offsets()
    host = dict(kw, cu_seqlens_q=cq, cu_seqlens_k=ck)
    int8.forward(q, k, v, **dict(host, max_seqlen_q=129))
    with pytest.raises(ValueError, match=r"max_seqlen_k=69 is less than the longest sequence \(70\)"):
        int8.forward(q, k, v, **dict(host, max_seqlen_k=69))  # host offsets: compared on every call


def test_strided_device_offsets_pass_their_stride(gpu):
    from sagecupy import int8

    q, k, v, kw = _packed()
    base = FakeArray((10,), np.int32)
    cu = FakeArray((5,), np.int32, strides=(8,), ptr=base.data.ptr)
    int8.forward(q, k, v, **dict(kw, cu_seqlens_q=cu))
    offs = gpu[0]
    assert offs[0] == "packed_offsets" and int(offs[3][1]) == 2 and int(offs[3][3]) == 1


def test_window_and_causal_reach_the_packed_kernels(gpu):
    """The kernels get the window clamped against the totals (kernel_window); each CTA clamps it again against its
    own sequence (kernels_cu/int8/packed.cuh packed_window)."""
    from sagecupy import int8

    q, k, v, kw = _packed()
    for causal, window, want in ((True, None, (-1, 0)), (False, (17, 3), (17, 3)), (False, (TK, TQ), (-1, -1)),
                                 (True, (5, 0), (5, 0))):
        start = len(gpu)
        o, res = int8.forward(q, k, v, causal=causal, window=window, engine="mma", **kw)
        int8.backward(res, FakeArray(q.shape, q.dtype), engine="mma")
        for launch in gpu[start:]:
            if launch[0].startswith("int8_attn"):
                args = launch[3]
                i = next(n for n, a in enumerate(args) if isinstance(a, np.float32))
                assert (int(args[i + 1]), int(args[i + 2])) == want, launch[0]


def test_packed_configs_launch_the_per_block_passes(gpu):
    """The per-block configs ("paper": per-block Q, K and V) take quant_rows_packed per axis with the table of that
    axis (kside), and one column statistic (K's mean) without V's channel scales."""
    from sagecupy import _checks, int8

    q, k, v, kw = _packed(d=128)
    tq_pad, tk_pad, _, _, nchk = _checks.packed_bounds(len(S_LENS), TQ, TK)
    int8.forward(q, k, v, config="paper", engine="mma", **kw)
    names = _names(gpu)
    assert names[2:6] == ["column_partial_packed", "column_finish_packed", "quant_rows_packed", "quant_rows_packed"]
    qrows, krows = gpu[4], gpu[5]
    assert qrows[1] == (tq_pad // 128, 4, 1) and krows[1] == (tk_pad // 64, 2, 1)
    assert int(qrows[3][14]) == 0 and int(krows[3][14]) == 1  # kside
    assert gpu[2][1] == (nchk, 2, 1) and gpu[3][1] == (len(S_LENS) * 2,)


def test_totals_may_be_zero(gpu):
    from sagecupy import int8

    q, k, v, kw = _packed(tq=0, tk=0, s=2)
    o, lse, res = int8.forward(q, k, v, return_lse=True, **kw)
    assert o.shape == (0, 4, 64) and lse.shape == (4, 0)
    dq, dk, dv = int8.backward(res, FakeArray(q.shape, q.dtype))
    assert dq.shape == (0, 4, 64) and dk.shape == (0, 2, 64)


# ---- residuals ----

def test_packed_residuals_are_checked(gpu):
    from sagecupy import int8

    q, k, v, kw = _packed()
    _, res = int8.forward(q, k, v, **kw)
    do = FakeArray(q.shape, q.dtype)
    start = len(gpu)
    for field, value, exc, words in (
            ("packed", None, TypeError, r"residuals\.packed must be a CuPy array"),
            ("packed", FakeArray((7,), np.int32), ValueError, r"residuals\.packed\.shape=\(7,\) must be"),
            ("q_codes", FakeArray((4, 64), np.int8), ValueError, r"residuals\.q_codes\.shape"),
            ("lse2", FakeArray(res.lse2.shape, np.float16), TypeError, r"residuals\.lse2\.dtype"),
            ("mu_k", FakeArray((len(S_LENS) + 1, 2, 64), np.float32), ValueError, r"residuals\.mu_k\.shape"),
            ("o", FakeArray((TQ + 1, 4, 64), np.float16), ValueError, r"residuals\.o\.shape"),
            ("problem", dataclasses.replace(res.problem, nq=-1), ValueError, r"residuals\.problem\.nq=-1")):
        with pytest.raises(exc, match=words):
            int8.backward(dataclasses.replace(res, **{field: value}), do)
    with pytest.raises(ValueError, match=r"do\.shape"):
        int8.backward(res, FakeArray((TQ, 4, 128), np.float16))
    assert len(gpu) == start
    dense_q = FakeArray((1, 4, 128, 64), np.float16)
    dense_k = FakeArray((1, 2, 128, 64), np.float16)
    _, dense = int8.forward(dense_q, dense_k, dense_k)
    with pytest.raises(ValueError, match=r"residuals\.packed .* must be None for layout='HND'"):
        int8.backward(dataclasses.replace(dense, packed=res.packed), FakeArray(dense_q.shape, np.float16))


# ---- the table, modelled in NumPy ----

def _random_offsets(rng, S, total, valid):
    lens = rng.integers(0, 3, S) * rng.integers(0, 300, S)  # many empty sequences
    cu = np.concatenate([[0], np.cumsum(lens)])
    if total is not None:
        cu[-1] = max(cu[-1], total)
    if not valid:  # what unchecked device offsets may hold
        cu = cu + rng.integers(-400, 400, S + 1)
    return cu


@pytest.mark.parametrize("seed", range(40))
def test_table_covers_every_sequence_within_the_bounds(seed):
    """For any offsets (valid ones, and arbitrary values as unchecked device arrays may hold), the table's padded
    offsets stay within the host's bounds, every 64-row block and chunk of a sequence points to it, and the rest
    to none: the kernels never index past a buffer."""
    from sagecupy import _checks, _varlen

    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 40))
    valid = seed % 2 == 0
    cq, ck = _random_offsets(rng, S, None, valid), _random_offsets(rng, S, None, valid)
    tq, tk = (max(int(c.max()), 0) + int(rng.integers(0, 3)) for c in (cq, ck))
    if valid:
        tq, tk = int(cq[-1]), int(ck[-1])
    m = _varlen.reference_meta(cq, ck, tq, tk).astype(np.int64)
    tq_pad, tk_pad, nbq, nbk, nchk = _checks.packed_bounds(S, tq, tk)
    n1 = S + 1
    q, k, pq, pk, pc = (m[i * n1:(i + 1) * n1] for i in range(5))
    blk_q, blk_k, chk = m[5 * n1:5 * n1 + nbq], m[5 * n1 + nbq:5 * n1 + nbq + nbk], m[5 * n1 + nbq + nbk:]
    assert m.size == 5 * n1 + nbq + nbk + nchk and chk.size == nchk
    for c, total in ((q, tq), (k, tk)):
        assert c.min() >= 0 and c.max() <= total and np.all(np.diff(c) >= 0)
        if valid:
            np.testing.assert_array_equal(c, cq if c is q else ck)
    assert pq[-1] <= tq_pad and pk[-1] <= tk_pad and pc[-1] <= nchk
    for s in range(S):
        nq, nk = q[s + 1] - q[s], k[s + 1] - k[s]
        assert pq[s + 1] - pq[s] == -(-nq // 128) * 128 and pk[s + 1] - pk[s] == -(-nk // 128) * 128
        assert pc[s + 1] - pc[s] == -(-nk // 256)
        assert np.all(blk_q[pq[s] // 64:pq[s + 1] // 64] == s) and np.all(blk_k[pk[s] // 64:pk[s + 1] // 64] == s)
        assert np.all(chk[pc[s]:pc[s + 1]] == s)
    assert np.all(blk_q[pq[-1] // 64:] == -1) and np.all(blk_k[pk[-1] // 64:] == -1) and np.all(chk[pc[-1]:] == -1)


# ---- the autograd shim on NumPy ----

SHIM_LENS = [(5, 7), (0, 3), (9, 0), (1, 1), (12, 12)]


def _shim_inputs(seed, Hq=4, Hkv=2, D=8):
    r = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum([a for a, _ in SHIM_LENS])])
    ck = np.concatenate([[0], np.cumsum([b for _, b in SHIM_LENS])])
    q, k, v = (r.standard_normal(s) for s in ((cq[-1], Hq, D), (ck[-1], Hkv, D), (ck[-1], Hkv, D)))
    return q, k, v, r.standard_normal(q.shape), cq, ck


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (2, 1))])
def test_fpa_packed_matches_reference(causal, window):
    from sagecupy import autograd as ag
    from sagecupy.reference import attention as A

    q, k, v, do, cq, ck = _shim_inputs(3)
    packed = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    o, res = ag.fpa_forward(q, k, v, causal=causal, window=window, **packed)
    o_ref, lse = A.attention_forward(q, k, v, causal=causal, window=window, layout="THD", **packed)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    want = A.attention_backward(q, k, v, o_ref, lse, do, causal=causal, window=window, layout="THD", **packed)
    for got, w in zip(ag.fpa_backward(res, do), want):
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["fpa", "sagebwd"])
def test_attention_op_takes_packed_sequences(impl):
    """ag.attention(layout="THD", cu_seqlens_q/k): the FPA baseline per sequence, or the SageBwd simulator (NumPy) on
    the packed call itself, bitwise the reference's."""
    from sagecupy import autograd as ag
    from sagecupy.reference import sagebwd as S

    q, k, v, do, cq, ck = _shim_inputs(4, D=64)
    qv, kv, vv = (ag.Variable(t) for t in (q, k, v))
    o = ag.attention(qv, kv, vv, impl=impl, causal=True, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck,
                     max_seqlen_q=12, max_seqlen_k=12)
    o.backward(do)
    if impl == "sagebwd":
        o_ref, res = S.forward(q, k, v, causal=True, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck)
        np.testing.assert_array_equal(o.value, o_ref)
        for got, want in zip((qv.grad, kv.grad, vv.grad), S.backward(res, do)):
            np.testing.assert_array_equal(got, want)
    else:
        assert qv.grad.shape == q.shape and kv.grad.shape == k.shape
        assert np.all(o.value[5:14] == 0) and np.all(qv.grad[5:14] == 0)  # the (9, 0) sequence's rows: no key
        assert np.all(vv.grad[7:10] == 0) and np.all(kv.grad[7:10] == 0)  # the (0, 3) sequence's keys: no query
    with pytest.raises(ValueError, match="impl='fpa' takes layout='HND' or 'THD'"):
        ag.attention(q, k, v, impl="fpa", layout="NHD")
