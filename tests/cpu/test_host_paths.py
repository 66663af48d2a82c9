"""The INT8 and NVFP4 host paths without a GPU: a stand-in `cupy` (arrays that carry only shape, strides, dtype and
an address) and recording kernels. Checks that a replayed call (sagecupy/_program.py) launches exactly what the
first call of its signature launched, on its own new outputs, and that validation still runs where it must."""
import math
import sys
import types

import numpy as np
import pytest


class FakeArray:
    """What the host code reads from a CuPy array; each allocation gets its own 256-byte aligned address."""

    _next = [1 << 20]

    def __init__(self, shape, dtype, strides=None, ptr=None):
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.itemsize, self.ndim, self.size = self.dtype.itemsize, len(self.shape), math.prod(self.shape)
        if strides is None:
            strides, acc = [], self.itemsize
            for s in reversed(self.shape):
                strides.insert(0, acc)
                acc *= s
        self.strides = tuple(strides)
        if ptr is None:
            ptr = FakeArray._next[0]
            FakeArray._next[0] += (math.prod(self.shape) * self.itemsize + 511) // 256 * 256
        self.data = types.SimpleNamespace(ptr=ptr, device_id=0)  # a MemoryPointer's address and device

    @property
    def flags(self):
        return types.SimpleNamespace(c_contiguous=self.strides == FakeArray(self.shape, self.dtype, ptr=0).strides)

    def __getitem__(self, i):
        assert isinstance(i, int)
        return FakeArray(self.shape[1:], self.dtype, self.strides[1:], self.data.ptr + i * self.strides[0])

    def copy(self):
        return FakeArray(self.shape, self.dtype)


def _ascontiguousarray(x, dtype=None):
    """CuPy's: the array itself when it already is C-contiguous in that dtype, else a copy."""
    same = dtype is None or np.dtype(dtype) == x.dtype
    return x if same and x.strides == FakeArray(x.shape, x.dtype, ptr=0).strides else FakeArray(x.shape, dtype or x.dtype)


class Kernel:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, grid, block, args, shared_mem=0):
        assert isinstance(args, tuple)
        self.log.append((self.name, tuple(grid), tuple(block), args, shared_mem))


@pytest.fixture
def gpu(monkeypatch):
    """A fake cupy module and recording kernels; returns the launch log."""
    log = []
    kernels = {}
    fake = types.SimpleNamespace(
        ndarray=FakeArray, empty=lambda shape, dtype: FakeArray(shape, dtype),
        zeros=lambda shape, dtype: FakeArray((shape,) if isinstance(shape, int) else shape, dtype),
        ascontiguousarray=_ascontiguousarray,
        int8=np.int8, uint8=np.uint8, float16=np.float16, uint16=np.uint16, float32=np.float32,
        float64=np.float64, int32=np.int32, int64=np.int64, uint32=np.uint32,
        cuda=types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(id=0),
                                   runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from sagecupy import _layout, int8, nvfp4, qat

    def get_function(filename, name, all_names=None, arch=None):
        return kernels.setdefault(name, Kernel(name, log))

    for mod in (int8, nvfp4, qat):
        monkeypatch.setattr(mod, "get_function", get_function)
    for mod in (int8, nvfp4, _layout):
        monkeypatch.setattr(mod, "device_capability", lambda: (9, 0))
    monkeypatch.setattr(nvfp4, "_smem_optin", lambda device_id: 227 * 1024)
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 132)  # (an H200's; tests that need another set theirs)
    from sagecupy._program import _ENV_VARS

    for var in (*_ENV_VARS, "SAGECUPY_LAUNCH"):  # (the code's defaults: a test sets what it is about)
        monkeypatch.delenv(var, raising=False)
    return log


def _summary(launch, inputs, base=0):
    """A launch with its arrays described by shape and dtype (and by name for the call's inputs); a scratch buffer
    inside the call's arena (sagecupy/_program.py ``_Arena``: its address, passed as an 8-byte unsigned scalar) by
    its offset from ``base`` (see :func:`_arena_base`)."""
    name, grid, block, args, smem = launch

    def arg(a):
        if isinstance(a, FakeArray):
            for n, x in inputs.items():
                if a is x:
                    return ("input", n)
            return ("array", a.shape, a.dtype.str)
        if isinstance(a, np.uint64):  # no kernel of ours takes a 64-bit unsigned scalar: an arena address
            return ("arena", int(a) - base)
        return a if a is None else (type(a).__name__, a.item())

    return name, grid, block, tuple(arg(a) for a in args), smem


def _arena_base(launches):
    """The lowest arena address the launches pass (0 if none): offsets from it compare calls."""
    return min((int(a) for x in launches for a in x[3] if isinstance(a, np.uint64)), default=0)


def _inputs(layout="HND", dtype=np.float16, nq=100, nk=70, d=128):
    shp = (lambda h, n: (2, h, n, d)) if layout == "HND" else (lambda h, n: (2, n, h, d))
    return FakeArray(shp(4, nq), dtype), FakeArray(shp(2, nk), dtype), FakeArray(shp(2, nk), dtype)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_int8_replay_launches_what_the_first_call_launched(gpu, layout, engine):
    from sagecupy import int8

    q, k, v = _inputs(layout)
    do = FakeArray(q.shape, q.dtype)
    runs = []
    for _ in range(2):
        start = len(gpu)
        o, res = int8.forward(q, k, v, causal=True, layout=layout, engine=engine)
        dq, dk, dv = int8.backward(res, do, engine=engine)
        runs.append((gpu[start:], (o, res, dq, dk, dv)))
    (first, out1), (second, out2) = runs
    names = dict(q=q, k=k, v=v, do=do)
    b1, b2 = _arena_base(first), _arena_base(second)
    assert b1 != b2  # each call its own scratch arena
    assert [_summary(x, names, b1) for x in first] == [_summary(x, names, b2) for x in second]
    # forward: the K/V statistics (partials, reduction); Q/K, then V (merged on the wgmma engine at D = 128: one
    # launch); the attention kernel. Backward: 2 pre-passes, 2 kernels.
    quant = ["quant_qkv"] if engine == "wgmma" else ["quant_rows_qk", "quant_transpose_perm"]
    fwd = ["column_partial_kv", "column_finish_kv"] + quant
    assert [x[0].split("<")[0] for x in first[:len(fwd) + 1]] == fwd + ["int8_attn_fwd_sm90" if engine == "wgmma"
                                                                          else "int8_attn_fwd"]
    assert len(first) == len(fwd) + 5
    # every call its own outputs
    for a, b in zip(out1, out2):
        assert a is not b
    assert out1[1].q_codes is not out2[1].q_codes
    # the forward kernel reads this call's pre-pass outputs and writes this call's o
    fwd = next(x for x in second if x[0].startswith("int8_attn_fwd"))
    assert out2[1].q_codes in fwd[3] and out2[0] in fwd[3] and out1[0] not in fwd[3]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("config", ["default", "paper"])
@pytest.mark.parametrize("engine", ["wgmma", "mma", None])
def test_int8_sage_attention_launches_forwards_kernels_without_plain_k(gpu, engine, config, d):
    """sage_attention (no residuals) launches the kernels int8.forward launches, with the same grids and scalar
    arguments (nk_pad included); on the wgmma engine only K's plain codes and scales are null (the kernel reads K
    from the stage images), on the mma.sync engine nothing is. Its program is a plan of its own. ``engine=None``:
    the wgmma engine of the (faked) sm_90 device."""
    from sagecupy import int8

    q, k, v = _inputs(d=d, nk=300)
    start = len(gpu)
    int8.forward(q, k, v, causal=True, config=config, engine=engine)
    train = gpu[start:]
    for _ in range(2):  # recorded, then replayed
        start = len(gpu)
        o = int8.sage_attention(q, k, v, causal=True, config=config, engine=engine)
        infer = gpu[start:]
        assert isinstance(o, FakeArray)
        assert [x[0] for x in infer] == [x[0] for x in train]
        nulled = []  # (kernel, the arrays forward passes where sage_attention passes null)
        for a, b in zip(train, infer):
            assert (a[1], a[2], a[4]) == (b[1], b[2], b[4]), a[0]
            # scalars equal; a buffer (an array of its own, or an arena address: np.uint64) where forward has one
            scalars = [[x.item() for x in launch[3] if isinstance(x, np.generic) and not isinstance(x, np.uint64)]
                       for launch in (a, b)]
            assert scalars[0] == scalars[1], a[0]
            buffers = [[isinstance(x, (FakeArray, np.uint64)) for x in launch[3]] for launch in (a, b)]
            assert all(bb or y is None for ba, bb, y in zip(*buffers, b[3]) if ba), a[0]
            null_a = {i for i, x in enumerate(a[3]) if x is None}
            null_b = {i for i, x in enumerate(b[3]) if x is None}
            assert null_a <= null_b, a[0]
            if null_b - null_a:
                nulled.append((a[0].split("<")[0], [type(a[3][i]).__name__ for i in sorted(null_b - null_a)]))
        if engine == "mma":
            assert nulled == []
        else:  # the K rows' launch (codes, scales) and the attention kernel (kc, ks)
            k_pass = ("quant_qkv" if d == 128 and config == "default" else
                      "quant_rows_qk" if config == "default" else "quant_rows")
            assert [n for n, _ in nulled] == [k_pass, "int8_attn_fwd_sm90"], nulled
            # the nulled arguments are buffers in forward: K's codes and scales (arrays of their own, residuals)
            assert all(arrays == ["FakeArray", "FakeArray"] for _, arrays in nulled), nulled


def test_int8_validation_runs_on_replayed_calls(gpu):
    from sagecupy import int8

    q, k, v = _inputs()
    int8.forward(q, k, v)
    int8.forward(q, k, v)  # replayed
    with pytest.raises(TypeError, match="causal"):
        int8.forward(q, k, v, causal=1)
    with pytest.raises(ValueError, match="sm_scale"):
        int8.forward(q, k, v, sm_scale=float("nan"))
    with pytest.raises(ValueError, match="device"):
        q.data.device_id = 1
        int8.forward(q, k, v)
    q.data.device_id = 0
    _, res = int8.forward(q, k, v)
    with pytest.raises(ValueError, match="do.shape"):
        int8.backward(res, FakeArray((2, 4, 99, 128), np.float16))
    with pytest.raises(TypeError, match="residuals"):
        int8.backward(object(), FakeArray(q.shape, q.dtype))


def test_int8_copies_misaligned_inputs_on_every_call(gpu):
    """A misaligned input is copied per call (its strides in the launch are the copy's)."""
    from sagecupy import int8

    q, k, v = _inputs()
    k_odd = FakeArray(k.shape, k.dtype, ptr=k.data.ptr + 2)
    for _ in range(2):
        start = len(gpu)
        int8.forward(q, k_odd, v)
        for launch in gpu[start:]:
            assert k_odd not in launch[3]


def test_nvfp4_replay_launches_what_the_first_call_launched(gpu):
    from sagecupy import nvfp4

    q, k, v = _inputs(nk=128)  # (a length that needs no V padding: the fake has no cupy.zeros)
    nvfp4.attention(q, k, v, causal=True)
    n = len(gpu)
    nvfp4.attention(q, k, v, causal=True)
    names = dict(q=q, k=k, v=v)
    b1, b2 = _arena_base(gpu[:n]), _arena_base(gpu[n:])
    assert [_summary(x, names, b1) for x in gpu[:n]] == [_summary(x, names, b2) for x in gpu[n:]]


def test_nvfp4_quantize_inputs_takes_the_k_mean_in_two_launches(gpu):
    """quantize_inputs' K mean (int8._column_stat, a one-off program): the column kernels on K, then the
    quantizers, the mean's output reaching the K quantizer."""
    from sagecupy import nvfp4

    q, k, v = _inputs(nk=128)
    ops = nvfp4.quantize_inputs(q, k, v)
    names = [x[0] for x in gpu]
    assert names[:2] == ["column_partial<__half, 128, false>", "column_finish<false>"]
    assert ops["mu_k"].shape == (2, 2, 128) and ops["mu_k"] in gpu[1][3]
    k_quant = [x for x in gpu if x[0].startswith("nvfp4_quant_rows") and ops["mu_k"] in x[3]]
    assert len(k_quant) == 1 and k in k_quant[0][3]


@pytest.mark.parametrize("d", [64, 128])
def test_nvfp4_fused_prepass_passes_what_the_split_launches_pass(gpu, d, monkeypatch):
    """SAGECUPY_FP4_PREPASS=fused: V's quantizer with K's column sums over the same 64-token tiles, K's mean from
    those sums, then Q's and K's row quantizers in one launch, whose two halves get the split launches' arguments;
    the attention kernel after them is launched as with the split pre-pass."""
    monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "0")  # (the kernels that read the packed K and V)
    from sagecupy import nvfp4

    nvfp4._ATTN_PLANS.clear()  # (plans recorded by earlier tests launch that test's recording kernels)
    monkeypatch.setenv("SAGECUPY_FP4_QIN", "0")  # (Q's quantizer in the pre-pass)
    monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", "0")
    q, k, v = _inputs(nk=128, d=d)  # B = 2, Hq = 4, Hkv = 2, nq = 100, nk = 128
    names = dict(q=q, k=k, v=v)
    runs = {}
    for mode in ("split", "fused"):
        monkeypatch.setenv("SAGECUPY_FP4_PREPASS", mode)
        start = len(gpu)
        nvfp4.attention(q, k, v, causal=True)
        runs[mode] = gpu[start:]
    split, fused = runs["split"], runs["fused"]
    assert [x[0].split("<")[0] for x in split[:5]] == ["column_partial", "column_finish", "nvfp4_quant_rows",
                                                       "nvfp4_quant_rows", "nvfp4_quant_tokens_tiled"]
    kpart, finish, qk = fused[:3]
    assert [x[0] for x in fused[:3]] == [f"nvfp4_quant_v_kpart<__half, {d}>", f"nvfp4_kmean_finish<{d}>",
                                         f"nvfp4_quant_qk_rows<__half, {d}>"]
    assert len(fused) == len(split) - 2
    # the attention kernel: the same launch (its operands are arrays of the same shapes, the same scalars)
    assert [_summary(x, names) for x in fused[3:]] == [_summary(x, names) for x in split[5:]]
    # V's quantizer and K's column sums: grid (ceil(N16 / 64), Hkv, B); V's arguments as the split launch's
    sq, sk, sv, kp, qk = (_summary(x, names) for x in (split[2], split[3], split[4], fused[0], fused[2]))
    assert kp[1:3] == (sv[1], (128,)) == ((2, 2, 2), (128,))
    assert kp[3][:4] == sv[3][:4] and kp[3][4:8] == sk[3][:4]  # V, its strides; K, its strides
    assert kp[3][8] == sv[3][4] and kp[3][9:12] == sv[3][6:9]  # nk; n16, V's codes, V's scales
    part = kpart[3][12]
    assert isinstance(part, np.uint64)  # (scratch, in the call's arena)
    # the mean: one block of D threads per (batch, KV head), reading those sums
    assert finish[1:3] == ((4,), (d,)) and finish[3][0] == part and finish[3][1:3] == (np.int32(2), np.int32(128))
    mu = finish[3][3]
    assert mu.shape == (2, 2, d) and mu.dtype == np.float32
    # Q's and K's quantizers: grid (gq Hq + gk Hkv, 1, B), each half with the split launch's arguments
    gq, gk = sq[1][0], sk[1][0]
    assert sq[1] == (gq, 4, 2) and sk[1] == (gk, 2, 2) and qk[1:3] == ((gq * 4 + gk * 2, 1, 2), (256,))
    a = qk[3]
    assert a[:5] == sq[3][:5] and a[5:7] == (("int32", 4), ("int32", gq))  # Q, strides, nq; Hq, gq
    assert a[7:9] == sq[3][8:10] and a[9:13] == sq[3][10:14]  # Q's codes, scales; the dot's mean, group, scale, qmk
    assert a[13:18] == sk[3][:5] and a[18:20] == (("int32", 2), ("int32", gk))  # K, strides, nk; Hkv, gk
    assert a[20] == sk[3][6] and a[21:23] == sk[3][8:10] and a[23] == ("int32", d)  # K's mean, codes, scales
    assert sq[3][10] == sk[3][6] == ("array", (2, 2, d), "<f4")  # (both: K's mean)
    raw = fused[2][3]
    assert raw[9] is mu and raw[20] is mu  # (this call's mean, from the launch before)
    assert all(any(x is y for y in fused[3][3]) for x in (raw[7], raw[8], raw[12], raw[21], raw[22]))  # -> kernel
    assert any(x is fused[0][3][10] for x in fused[3][3])  # V's codes -> the kernel


@pytest.mark.parametrize("sms", [1, 40])
@pytest.mark.parametrize("d", [64, 128])
def test_nvfp4_pipelined_prepass_passes_what_the_fused_launches_pass(gpu, d, sms, monkeypatch):
    """SAGECUPY_FP4_PREPASS=pipe: the fused pre-pass's three launches with the pipelined kernels, whose CTAs walk one
    flat list of pieces over all heads (V's 64-token tiles; Q's then K's row chunks of 256 threads x 32 elements):
    1-D grids of min(pieces, CTAs resident at once: 4 per SM for V's kernel, 3 for the rows', their launch bounds);
    the fused launches' arguments otherwise (without gq, gk, d; with the tile count, heads and batch)."""
    monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "0")  # (the kernels that read the packed K and V)
    from sagecupy import nvfp4

    nvfp4._ATTN_PLANS.clear()
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: sms)
    monkeypatch.setenv("SAGECUPY_FP4_QIN", "0")  # (Q's chunks in the rows kernel)
    monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", "0")
    # B = 3, Hq = 4, Hkv = 1 (GQA), nq = 100, nk = 256: 4 tiles of 64 keys (ntile, Hkv and B all differ)
    q, k, v = (FakeArray((3, h, n, d), np.float16) for h, n in ((4, 100), (1, 256), (1, 256)))
    names = dict(q=q, k=k, v=v)
    runs = {}
    for mode in ("fused", "pipe"):
        monkeypatch.setenv("SAGECUPY_FP4_PREPASS", mode)
        start = len(gpu)
        nvfp4.attention(q, k, v, causal=True)
        runs[mode] = [_summary(x, names, _arena_base(gpu[start:])) for x in gpu[start:]]
    fused, pipe = runs["fused"], runs["pipe"]
    assert [x[0] for x in pipe[:3]] == [f"nvfp4_quant_v_kpart_pipe<__half, {d}>", f"nvfp4_kmean_finish<{d}>",
                                        f"nvfp4_quant_qk_rows_pipe<__half, {d}>"]
    assert pipe[1] == fused[1] and pipe[3:] == fused[3:]  # the mean, the attention kernel
    chunks = lambda n: (n * (d // 32) + 255) // 256  # noqa: E731
    v_pieces, r_pieces = 3 * 1 * 4, 3 * (4 * chunks(100) + 1 * chunks(256))
    assert pipe[0][1:3] == ((min(v_pieces, 4 * sms),), (128,))
    assert pipe[2][1:3] == ((min(r_pieces, 3 * sms),), (256,))
    fv, fr = fused[0][3], fused[2][3]
    div = lambda d: ("int64", int(nvfp4._fast_div(d)))  # noqa: E731
    # ntile, Hkv, B and the divisions by ntile and Hkv
    assert pipe[0][3] == fv[:10] + (("int32", 4), ("int32", 1), ("int32", 3), div(4), div(1)) + fv[10:]
    # without gq, gk, d; with B and the divisions by Q's and K's chunks per head, Hq and Hkv
    assert pipe[2][3] == fr[:6] + fr[7:19] + fr[20:23] + (("int32", 3),) + tuple(
        div(x) for x in (chunks(100), chunks(256), 4, 1))


def test_nvfp4_fast_div_multipliers_divide_exactly(gpu):
    """nvfp4._fast_div's l << 32 | m (the pipelined pre-pass kernels' FastDiv): (hi(n m) + n) >> l == n // d in the
    kernels' 32-bit arithmetic for every divisor up to 4096, powers of two and their neighbours, large divisors, and
    n over [0, 2^31): the edges of every quotient (k d - 1, k d) and random values."""
    from sagecupy import nvfp4

    rng = np.random.default_rng(0)
    ds = sorted({*range(1, 4097), *(2**k + e for k in range(1, 31) for e in (-1, 0, 1)), 2**31 - 1,
                 *rng.integers(4097, 2**31, 300).tolist()})
    for d in ds:
        ml = int(nvfp4._fast_div(d))
        m, l = ml & 0xFFFFFFFF, ml >> 32
        assert 0 < m < 2**32 and l < 32
        k = np.unique(np.concatenate([np.arange(1, 65), rng.integers(1, (2**31 - 1) // d + 1, 64)]))
        n = np.concatenate([k * d - 1, k * d, rng.integers(0, 2**31, 256)]).astype(np.uint64)
        n = n[n < 2**31]
        q = (((n * np.uint64(m)) >> np.uint64(32)) + n) >> np.uint64(l)  # (hi(n m) + n < 2^32: no 32-bit wrap)
        assert np.all(q < 2**32) and np.array_equal(q, n // np.uint64(d)), d


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("smooth", [True, False])
@pytest.mark.parametrize("mode", ["split", "fused", "pipe"])
def test_nvfp4_q_in_kernel_launches(gpu, mode, smooth, layout, monkeypatch):
    """SAGECUPY_FP4_QIN=1: no Q quantizer (and no qmk array); the pre-pass's other launches as without it (pipe: its
    rows kernel with K's chunks only, nq = 0); nvfp4_attn_fwd_ws_qin gets the raw Q with the strides Q's quantizer
    gets, K's mean (the array K's quantizer subtracts; null without K-smoothing) and sm_scale in place of Q's bytes
    and qmk, and the warp-specialized kernel's other arguments."""
    monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "0")  # (the kernels that read the packed K and V)
    from sagecupy import nvfp4
    from sagecupy.config import NVFP4Config

    nvfp4._ATTN_PLANS.clear()
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 40)
    monkeypatch.setenv("SAGECUPY_FP4_PREPASS", mode)
    q, k, v = _inputs(layout=layout, nk=128)  # B = 2, Hq = 4, Hkv = 2, nq = 100, nk = 128
    names = dict(q=q, k=k, v=v)
    cfg = NVFP4Config(k_smoothing=smooth)
    runs = {}
    for qin in ("0", "1"):
        monkeypatch.setenv("SAGECUPY_FP4_QIN", qin)
        start = len(gpu)
        nvfp4.attention(q, k, v, causal=True, layout=layout, config=cfg, sm_scale=0.125)
        runs[qin] = gpu[start:]
    plain, qin = runs["0"], runs["1"]
    fused = mode != "split" and smooth
    pn, qn = [x[0].split("<")[0] for x in plain], [x[0].split("<")[0] for x in qin]
    if not fused:  # the split pre-pass without Q's quantizer (the first nvfp4_quant_rows)
        i = pn.index("nvfp4_quant_rows")
        assert qn[:-1] == pn[:i] + pn[i + 1:-1]
        q_launch = _summary(plain[i], names)
    elif mode == "fused":  # Q's and K's rows kernel -> K's nvfp4_quant_rows
        assert pn[:2] == qn[:2] and pn[2] == "nvfp4_quant_qk_rows" and qn[2] == "nvfp4_quant_rows"
        q_launch = None
    else:
        assert pn[:-1] == qn[:-1]
        rp, rq = _summary(plain[2], names), _summary(qin[2], names)
        chunks = lambda n: (n * 4 + 255) // 256  # noqa: E731
        assert rp[1] == (2 * (4 * chunks(100) + 2 * chunks(128)),) and rq[1] == (2 * 2 * chunks(128),)
        assert rq[3][:6] == (None, ("int64", 0), ("int64", 0), ("int64", 0), ("int32", 0), ("int32", 4))
        assert rq[3][6:8] == (None, None) and rq[3][11] is None  # no Q codes, scales, qmk
        assert rq[3][12:-4] == rp[3][12:-4] and rq[3][-3:] == rp[3][-3:]  # K's part; B, the other divisions
        assert rq[3][-4] == ("int64", int(nvfp4._fast_div(1)))  # (Q's chunks per head: none)
        q_launch = None
    name, grid, block, args, smem = qin[-1]
    assert name == "nvfp4_attn_fwd_ws_qin<__half, 128, true, 16, 3>"
    pk = _summary(plain[-1], names)
    assert pk[0] == "nvfp4_attn_fwd_ws<__half, 128, true, 16, 3>" and (grid, block, smem) == pk[1:3] + (pk[4],)
    a = _summary(qin[-1], names)[3]
    assert a[0] == ("input", "q") and a[5] == ("float32", 0.125)
    if q_launch is not None:
        assert a[1:4] == q_launch[3][1:4]  # Q's strides, as its quantizer gets them
    else:
        hn = (1, 2) if layout == "HND" else (2, 1)  # (the byte strides of the heads' and the tokens' axes)
        assert a[1:4] == tuple(("int64", q.strides[i] // 2) for i in (0, *hn))
    mu = args[4]
    if smooth:
        assert mu is not None and mu.shape == (2, 2, 128) and mu.dtype == np.float32
        # K's quantizer subtracts this mean and writes the codes and scales the kernel reads
        assert any("rows" in x[0] and any(y is mu for y in x[3]) and any(y is args[6] for y in x[3])
                   and any(y is args[7] for y in x[3]) for x in qin[:-1])
    else:
        assert mu is None
    assert a[6:] == pk[3][2:7] + pk[3][8:]  # K, V and the rest; Q's bytes and qmk dropped
    monkeypatch.setenv("SAGECUPY_FP4_QIN", "yes")
    with pytest.raises(ValueError, match="SAGECUPY_FP4_QIN='yes'"):
        nvfp4.attention(q, k, v, layout=layout)


def test_nvfp4_q_in_kernel_only_where_the_ws_kernel_runs(gpu, monkeypatch):
    """SAGECUPY_FP4_QIN=1 changes nothing where the three-consumer warp-specialized kernel does not run (D = 64, the
    mma engine, SAGECUPY_FP4_WS=2) or the persistent kernel does."""
    from sagecupy import nvfp4

    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 40)
    monkeypatch.setattr(nvfp4, "_zero_ints", lambda c: ())
    for env, d, engine in ((None, 64, None), (None, 128, "mma"), (("SAGECUPY_FP4_WS", "2"), 128, None),
                           (("SAGECUPY_FP4_PERSIST", "1"), 128, None)):
        nvfp4._ATTN_PLANS.clear()
        if env:
            monkeypatch.setenv(*env)
        q, k, v = _inputs(d=d, nk=128)
        runs = []
        for qin in ("0", "1"):
            monkeypatch.setenv("SAGECUPY_FP4_QIN", qin)
            start = len(gpu)
            nvfp4.attention(q, k, v, engine=engine)
            runs.append([x[0] if isinstance(x[0], str) and "<" in x[0] else "glue" for x in gpu[start:]])
        assert runs[0] == runs[1] and not any("qin" in x for x in runs[1])
        if env:
            monkeypatch.delenv(env[0])


def test_nvfp4_tail_split_plan(gpu):
    """_tail_split: the items past the last full wave split in 2-4 parts of their keys, the count that ends the tail
    soonest (in item times, 1 without a split), none where nothing is gained or a part would get < 4 key tiles."""
    from sagecupy import nvfp4

    assert nvfp4._tail_split(1408, 132, 64) == (1320, 3)  # B 4 x 16 heads x 22 blocks (4K): 10 2/3 instead of 11
    assert nvfp4._tail_split(1376, 132, 256) == (1320, 2)  # B 1 x 16 x 86 (16K): 10 1/2
    assert nvfp4._tail_split(40, 132, 64) == (0, 3)  # one partial wave: 120 parts
    assert nvfp4._tail_split(264, 132, 64) is None  # whole waves
    assert nvfp4._tail_split(1408, 132, 11) is None  # 2 parts need 8 tiles: 88 rest items -> 1 wave: no gain
    assert nvfp4._tail_split(1408, 132, 8) is None
    assert nvfp4._tail_split(131 + 132, 132, 64) is None  # 131 rest items: no split finishes sooner than 0.8
    for items in range(1, 700):
        for ntiles in (4, 8, 12, 16, 64):
            r = nvfp4._tail_split(items, 132, ntiles)
            if r is not None:
                whole, n = r
                rest = items - whole
                assert whole % 132 == 0 and 0 < rest < 132 and 2 <= n <= nvfp4._SPLIT_MAX and ntiles >= 4 * n
                assert -(-rest * n // 132) / n <= 0.8


@pytest.mark.parametrize("qin", ["0", "1"])
def test_nvfp4_tail_split_launch(gpu, qin, monkeypatch):
    """SAGECUPY_FP4_TAIL_SPLIT=1: the call zeroes the parts' counters first; nvfp4_attn_fwd_ws_split gets a 1-D grid
    (whole items, then every part of the rest), both Q forms' arguments (the plain kernel's or the Q-quantizing
    one's, the other form's null) and (whole, nsplit, nblk, the partials' scratch, the counters); causal calls,
    single-level P keep the plain kernel (attention_packed: the GPU test)."""
    monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "0")  # (the kernels that read the packed K and V)
    from sagecupy import nvfp4
    from sagecupy.config import NVFP4Config

    nvfp4._ATTN_PLANS.clear()
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 7)
    monkeypatch.setattr(nvfp4, "_zero_ints", lambda c: gpu.append(("zero", c)) or ())
    monkeypatch.setenv("SAGECUPY_FP4_QIN", qin)
    monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", "0")
    # B 2 x Hq 4 x 3 blocks of 192 rows = 24 items on 7 SMs: 21 whole, the other 3 in 2 parts of their 16 key tiles
    # (6 parts on 7 SMs: the tail takes 1/2 an item's time; 4 parts the same, 3 parts 2/3)
    q, k, v = _inputs(nq=400, nk=1024)
    names = dict(q=q, k=k, v=v)
    nvfp4.attention(q, k, v)
    plain = list(gpu)
    del gpu[:]
    monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", "1")
    for _ in range(2):  # recorded, then replayed
        start = len(gpu)
        nvfp4.attention(q, k, v)
        run = gpu[start:]
        assert run[0][0] == "zero" and [x[0] for x in run[1:-1]] == [x[0] for x in plain[:-1]]
        counters = run[0][1]
        assert counters.shape == (3 * 12,) and counters.dtype == np.int32
        name, grid, block, args, smem = run[-1]
        assert name == f"nvfp4_attn_fwd_ws_split<__half, 128, true, 3, {'true' if qin == '1' else 'false'}>"
        assert grid == (21 + 3 * 2,) and block == (512,) and smem == nvfp4.ws_smem_bytes(128, 3)
        assert args[-5:-2] == (np.int32(21), np.int32(2), np.int32(3)) and args[-1] is counters
        assert isinstance(args[-2], np.uint64)  # (the partials: scratch in the call's arena)
        pk, a = _summary(plain[-1], names)[3], _summary(run[-1], names)[3][:-5]
        if qin == "1":  # (Q's bytes null; the raw Q, strides, mean, scale; K, V ...; qmk null)
            assert a[:2] == (None, None) and a[2] == ("input", "q") and a[8:13] == pk[6:11] and a[13] is None
            assert a[14:] == pk[11:]
        else:  # (Q's bytes; the raw Q null; K, V, qmk and the rest as the plain kernel's)
            assert a[:2] == pk[:2] and a[2:5] == (None, ("int64", 0), ("int64", 0)) and a[6] is None
            assert a[8:] == pk[2:]
    del gpu[:]
    for kw in (dict(causal=True), dict(config=NVFP4Config(two_level_p=False))):
        nvfp4.attention(q, k, v, **kw)
        assert gpu[-1][0].startswith("nvfp4_attn_fwd_ws") and "split" not in gpu[-1][0]
        assert not any(x[0] == "zero" for x in gpu)


def _kv_img_kernel_check(plain, run, qin, split, names):
    """The last launch of ``run`` (SAGECUPY_FP4_KVIMG=1) against that of ``plain`` (=0): nvfp4_attn_fwd_ws_img with
    the images (the arena address the launch before it wrote) in place of the packed K and V, the same grid, block
    and shared memory, the rest of the arguments as the plain kernel's (split: the split kernel's)."""
    kname = plain[-1][0]
    name, grid, block, args, smem = run[-1]
    cg = kname.split("<")[1].rstrip(">").split(", ")[3] if "split" not in kname else "1"
    assert name == (f"nvfp4_attn_fwd_ws_img<__half, 128, true, {cg}, 3, {'true' if qin == '1' else 'false'}, "
                    f"{'true' if split else 'false'}>")
    assert (grid, block, smem) == plain[-1][1:3] + (plain[-1][4],)
    assert args[8] == run[-2][3][-1]  # (the images: their arena address, what the launch before wrote)
    a = _summary(run[-1], names, _arena_base(run[-1:]))[3]
    r = _summary(plain[-1], names, _arena_base(plain[-1:]))[3]
    if "split" in kname:  # (the split kernel's arguments with K and V replaced by the images)
        assert a[:8] == r[:8] and a[9:] == r[13:]
    elif qin == "1":  # (Q's bytes null; the raw Q, its strides, the mean and sm_scale; qmk null)
        assert a[:2] == (None, None) and a[2:8] == r[:6] and a[9] is None and a[10:-5] == r[11:]
    else:
        assert a[:2] == r[:2] and a[2:7] == (None, ("int64", 0), ("int64", 0), ("int64", 0), None)
        assert a[9:-5] == r[7:]
    if not split:
        assert a[-5:] == (("int32", 0), ("int32", 1), ("int32", 1), None, None)
    return a


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("qin", ["0", "1"])
def test_nvfp4_kv_images_launch(gpu, qin, split, monkeypatch):
    """SAGECUPY_FP4_KVIMG=1. attention: K's mean as the split pre-pass takes it, Q's quantizer (unless Q is quantized
    in the kernel), then nvfp4_kv_images_raw (grid: key tiles, Hkv, B; 128 threads; its dynamic shared memory) on the
    raw K and V with their strides and the mean, writing a scratch buffer in the call's arena, in place of K's and V's
    quantizers (whatever SAGECUPY_FP4_PREPASS says; =pipe: nvfp4_kv_images_raw_pipe on min(images, 3 per SM) CTAs
    with Hkv, the key tiles and the image count); attention_packed: nvfp4_kv_images on the packed K and V the
    kernel gets without it. Then nvfp4_attn_fwd_ws_img with the images in place of the packed K and V (both Q forms,
    the tail split's 1-D grid and arguments or their neutral values). Nothing changes where the three-consumer
    kernel does not run (D = 64, the persistent kernel, the mma engine)."""
    from sagecupy import nvfp4

    nvfp4._ATTN_PLANS.clear()
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 7 if split else 132)
    monkeypatch.setattr(nvfp4, "_zero_ints", lambda c: gpu.append(("zero", c)) or ())
    monkeypatch.setenv("SAGECUPY_FP4_QIN", qin)
    monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", "1" if split else "0")
    q, k, v = _inputs(nq=400, nk=1024)  # B 2, Hq 4, Hkv 2; 16 key tiles; split: 24 items on 7 SMs (a partial last
    # tile needs V padded, which the fake arrays cannot: the GPU test has one)
    names = dict(q=q, k=k, v=v)

    def launches(img, fn):
        monkeypatch.setenv("SAGECUPY_FP4_KVIMG", img)
        del gpu[:]
        fn()
        return list(gpu)

    for mode, img in (("split", "1"), ("pipe", "1"), ("split", "pipe")):
        monkeypatch.setenv("SAGECUPY_FP4_PREPASS", mode)
        call = lambda: nvfp4.attention(q, k, v, sm_scale=0.125)  # noqa: E731
        plain, run = launches("0", call), launches(img, call)
        monkeypatch.setenv("SAGECUPY_FP4_PREPASS", "split")
        split_plain = launches("0", call)
        pn, rn = [x[0].split("<")[0] for x in split_plain], [x[0].split("<")[0] for x in run]
        # (the split pre-pass: mean, [Q], K, V, kernel; with images: mean, [Q], the raw images, kernel)
        nq_rows = 0 if qin == "1" else 1
        kname = "nvfp4_kv_images_raw" + ("_pipe" if img == "pipe" else "")
        assert rn == pn[:-3] + [kname, "nvfp4_attn_fwd_ws_img"], (mode, rn)
        assert pn.count("nvfp4_quant_rows") == 1 + nq_rows
        iname, igrid, iblock, iargs, ismem = run[-2]
        assert iname == f"{kname}<__half, 128>" and iblock == (128,)
        ia = _summary(run[-2], names)[3]
        if img == "pipe":  # (2 x 2 x 16 images on min(64, 3 x SMs) resident CTAs; their count, Hkv, ntile)
            assert igrid == (min(64, 3 * (7 if split else 132)),) and ia[11:14] == (
                ("int32", 2), ("int32", 16), ("int32", 64))
            assert ismem == nvfp4.ws_img_raw_smem_bytes(128, True) == 32768 + 2 * 64 * 136 * 2 + 512
        else:
            assert igrid == (16, 2, 2) and len(ia) == 12
            assert ismem == nvfp4.ws_img_raw_smem_bytes(128) == 32768 + 64 * 136 * 2 + 512
        assert ia[0] == ("input", "k") and ia[5] == ("input", "v")
        assert ia[1:4] == tuple(("int64", k.strides[i] // 2) for i in (0, 1, 2))
        assert ia[6:9] == tuple(("int64", v.strides[i] // 2) for i in (0, 1, 2))
        assert ia[9:11] == (("int32", 1024), ("int32", 1024)) and isinstance(iargs[-1], np.uint64)
        mu = iargs[4]  # (K's mean: what the split pre-pass's K quantizer subtracts)
        kq = split_plain[pn.index("nvfp4_quant_rows") + nq_rows]
        assert mu is not None and mu.shape == (2, 2, 128) and _summary(kq, names)[3][6] == ("array", mu.shape, "<f4")
        assert any(mu is b for x in run[:-2] if len(x) == 5 for b in x[3][-1:])  # (written by the mean's pass)
        a = _kv_img_kernel_check(plain, run, qin, split, names)
        if qin == "1":
            assert a[6] == ("array", (2, 2, 128), "<f4") and run[-1][3][6] is mu
    launches("1", call)  # (replayed: the same launches)
    assert gpu[-2][0] == "nvfp4_kv_images_raw<__half, 128>"
    if qin == "0":  # attention_packed: the images from the packed K and V
        packed = {n: FakeArray(sh, np.uint8) for n, sh in (
            ("q_packed", (2, 4, 400, 64)), ("q_scales", (2, 4, 400, 8)), ("k_packed", (2, 2, 1024, 64)),
            ("k_scales", (2, 2, 1024, 8)), ("v_packed", (2, 2, 128, 512)), ("v_scales", (2, 2, 128, 64)))}
        names.update(packed)
        call = lambda: nvfp4.attention_packed(packed)  # noqa: E731
        plain, run = launches("0", call), launches("1", call)
        assert [x[0] for x in run[:-2]] == [x[0] for x in plain[:-1]]
        iname, igrid, iblock, iargs, _ = run[-2]
        assert iname == "nvfp4_kv_images<128>" and igrid == (16, 2, 2) and iblock == (128,)
        assert _summary(run[-2], names)[3][:7] == (("input", "k_packed"), ("input", "k_scales"), ("input", "v_packed"),
                                                   ("input", "v_scales"), ("int32", 512), ("int32", 1024),
                                                   ("int32", 1024))
        _kv_img_kernel_check(plain, run, qin, split, names)
    if not split:
        monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "1")
        for what in ("D=64", "persist", "mma"):
            del gpu[:]
            with monkeypatch.context() as m:
                if what == "persist":
                    m.setenv("SAGECUPY_FP4_PERSIST", "1")
                if what == "mma":
                    m.setenv("SAGECUPY_FP4_ENGINE", "mma")
                qq, kk, vv = _inputs(d=64, nq=400, nk=1024) if what == "D=64" else (q, k, v)
                nvfp4.attention(qq, kk, vv)
            assert not any("img" in x[0] or "images" in x[0] for x in gpu if isinstance(x[0], str)), what
    monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "on")
    with pytest.raises(ValueError, match="SAGECUPY_FP4_KVIMG='on' is not supported; supported: '0', '1', 'pipe'"):
        nvfp4.attention(q, k, v)


def test_nvfp4_persistent_kernel_launch(gpu, monkeypatch):
    """SAGECUPY_FP4_PERSIST=1: the call zeroes the item counter before its first launch (so the pre-pass and the
    kernel stay programmatic dependents of each other), then launches nvfp4_attn_fwd_ws_persist on min(items, SMs)
    CTAs with the warp-specialized kernel's arguments plus (B, counter, items)."""
    monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "0")  # (the kernels that read the packed K and V)
    from sagecupy import nvfp4

    nvfp4._ATTN_PLANS.clear()  # (plans recorded by earlier tests launch that test's recording kernels)
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 5)
    monkeypatch.setattr(nvfp4, "_zero_ints", lambda c: gpu.append(("zero", c)) or ())
    monkeypatch.setenv("SAGECUPY_FP4_QIN", "0")  # (the plain call: the warp-specialized kernel on the pre-pass's Q)
    q, k, v = _inputs(nk=128)  # B = 2, Hq = 4, nq = 100: one 192-row query block per head, 8 items
    nvfp4.attention(q, k, v, causal=True)
    plain = list(gpu)
    del gpu[:]
    monkeypatch.setenv("SAGECUPY_FP4_PERSIST", "1")
    for _ in range(2):  # recorded, then replayed
        start = len(gpu)
        nvfp4.attention(q, k, v, causal=True)
        run = gpu[start:]
        assert run[0][0] == "zero" and [x[0] for x in run[1:-1]] == [x[0] for x in plain[:-1]]
        counter = run[0][1]
        assert counter.shape == (1,) and counter.dtype == np.int32
        name, grid, block, args, smem = run[-1]
        assert name == "nvfp4_attn_fwd_ws_persist<__half, 128, true, 3>"
        assert grid == (5,) and block == (512,) and smem == nvfp4.ws_persist_smem_bytes(128)
        assert args[-3:] == (np.int32(2), counter, np.int32(8))
        names = dict(q=q, k=k, v=v)
        assert _summary(run[-1], names)[3][:-3] == _summary(plain[-1], names)[3]  # the WS kernel's arguments
    monkeypatch.setenv("SAGECUPY_FP4_PERSIST", "2")
    with pytest.raises(ValueError, match="SAGECUPY_FP4_PERSIST='2'"):
        nvfp4.attention(q, k, v)
