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
    fills = []  # (address, shape, value) of every fill, in order

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
        if isinstance(i, slice):  # rows start:stop of the first axis
            start, stop, step = i.indices(self.shape[0])
            assert step == 1
            return FakeArray((max(0, stop - start),) + self.shape[1:], self.dtype, self.strides,
                             self.data.ptr + start * self.strides[0])
        assert isinstance(i, int)
        return FakeArray(self.shape[1:], self.dtype, self.strides[1:], self.data.ptr + i * self.strides[0])

    def fill(self, value):
        FakeArray.fills.append((self.data.ptr, self.shape, value))

    def copy(self):
        return FakeArray(self.shape, self.dtype)


def stub_views(monkeypatch):
    """FakeArray.view (the same memory as another dtype of the same item size) and .transpose (the QAT mma.sync
    backward's view): what the bf16 paths ask of CuPy arrays."""
    def view(self, dtype):
        assert np.dtype(dtype).itemsize == self.itemsize
        return FakeArray(self.shape, dtype, self.strides, self.data.ptr)

    monkeypatch.setattr(FakeArray, "view", view, raising=False)
    monkeypatch.setattr(FakeArray, "transpose", lambda self, *ax: FakeArray(
        [self.shape[i] for i in ax], self.dtype, [self.strides[i] for i in ax], self.data.ptr), raising=False)


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
    # launch); the attention kernel. Backward: 2 pre-passes (mma.sync, the default's 16-bit dV, dK, dQ: delta alone),
    # 2 kernels.
    quant = ["quant_qkv"] if engine == "wgmma" else ["quant_rows_qk", "quant_transpose_perm"]
    fwd = ["column_partial_kv", "column_finish_kv"] + quant
    assert [x[0].split("<")[0] for x in first[:len(fwd) + 1]] == fwd + ["int8_attn_fwd_sm90" if engine == "wgmma"
                                                                          else "int8_attn_fwd"]
    assert len(first) == len(fwd) + (5 if engine == "wgmma" else 4)
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


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_int8_backward_kernels_follow_dv_int8_and_ds_int8(gpu, engine):
    """Each (dv_int8, ds_int8) pair the kernels implement launches its own instantiations (the (DV16, DS16)
    template arguments are the switches negated; the dO pre-pass of a 16-bit dV writes no dO codes, and the mma.sync
    engine transposes Q and K for INT8 dK and dQ only);
    an INT8 dV with 16-bit dQ and dK is refused before any launch, naming ds_int8."""
    from sagecupy import int8
    from sagecupy.config import DEFAULT

    q, k, v = _inputs(d=64)
    do = FakeArray(q.shape, q.dtype)
    sfx = "_sm90" if engine == "wgmma" else ""
    for (dv8, ds8), (dv16, ds16, do_pass) in {
        (True, True): ("false", "false", "bwd_do_image<__half, 64, 1>"),
        (False, True): ("true", "false", "bwd_do_image<__half, 64, 1>"),
        (False, False): ("true", "true", "bwd_do16_image<__half, 64>"),
    }.items():
        config = DEFAULT.replace(dv_int8=dv8, ds_int8=ds8)
        assert int8._unsupported_config(config) is None and int8.is_supported(q, k, v, config=config) == (True, "")
        _, res = int8.forward(q, k, v, config=config, engine=engine)
        start = len(gpu)
        int8.backward(res, do, engine=engine)
        # mma.sync: dO's codes for an INT8 dV only (else delta alone), Q's and K's transposes for INT8 dK and dQ only
        pre = ([f"bwd_qk_images<__half, 64, {ds16}>", do_pass] if engine == "wgmma"
               else (["quant_transpose_perm_delta<__half, 64, 1>"] if dv8 else ["bwd_delta<__half, 64>"])
               + (["transpose_i8_qk<64, true>"] if ds8 else []))
        assert [x[0] for x in gpu[start:]] == pre + [f"int8_attn_bwd{sfx}<__half, 64, {dv16}, {ds16}>",
                                                     f"int8_attn_bwd_dq{sfx}<__half, 64, {ds16}>"]
    refused = DEFAULT.replace(dv_int8=True)  # (ds_int8=False, the default's)
    why = int8._unsupported_config(refused)
    assert why and "ds_int8" in why and "dv_int8" in why
    assert int8.is_supported(q, k, v, config=refused) == (False, why)
    start = len(gpu)
    with pytest.raises(ValueError, match="ds_int8=False needs dv_int8=False"):
        int8.forward(q, k, v, config=refused, engine=engine)
    assert len(gpu) == start


def test_int8_mma_kernels_fit_the_smallest_block_shared_memory():
    """The mma.sync kernels run on every GPU from sm_80 on, and sm_86, sm_89 and sm_120 allow a block 99 KiB of
    shared memory (static and dynamic): every INT8 forward and backward launch of that engine, under each
    (dv_int8, ds_int8) pair the kernels implement, asks for at most that, less 64 bytes for the kernels' static
    scratch (the dQ kernel's 16-byte reduction buffer). The wgmma kernels need sm_90 (227 KiB)."""
    from sagecupy import int8

    limit = 99 * 1024 - 64
    for D in (64, 128):
        for bkv in int8._BLOCK_KV:
            assert int8._fwd_smem(D, bkv, 2) <= limit, (D, bkv)
        for dv8, ds8 in int8._BWD_MODES:
            kv, dq = int8.bwd_smem(D, "mma", ds8)
            assert kv <= limit and dq <= limit, (D, dv8, ds8, kv, dq)
        for ds8 in (True, False):
            kv, dq = int8.bwd_smem(D, "wgmma", ds8)
            assert kv <= 227 * 1024 and dq <= 227 * 1024, (D, ds8, kv, dq)

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


@pytest.mark.parametrize("engine, d", [("wgmma", 64), ("mma", 64), ("mma", 128)])
def test_nvfp4_launches_without_the_warp_specialized_kernel(gpu, engine, d):
    """Where the warp-specialized kernel does not run (D=64 on wgmma, the mma engine): K's mean, Q's quantizer (with
    qmk), K's (the mean subtracted) and V's tiled quantizers, then the kernel of the engine's CTA size (wgmma: 4
    warps, the causal dispatch group; mma.sync: 8 warps) on their outputs; no K/V stage images."""
    from sagecupy import nvfp4

    q, k, v = _inputs(nq=400, nk=1024, d=d)
    names = dict(q=q, k=k, v=v)
    for causal in (False, True):
        del gpu[:]
        nvfp4.attention(q, k, v, causal=causal, engine=engine)
        assert [x[0] for x in gpu[:-1]] == [f"column_partial<__half, {d}, false>", "column_finish<false>",
                                            f"nvfp4_quant_rows<__half, {d}>", f"nvfp4_quant_rows<__half, {d}>",
                                            "nvfp4_quant_tokens_tiled<__half>"]
        mu = gpu[1][3][-1]
        qa, ka, va = (_summary(x, names)[3] for x in gpu[2:5])
        assert qa[0] == ("input", "q") and gpu[2][3][10] is mu  # (qmk: the dot with K's mean in Q's quantizer)
        assert ka[0] == ("input", "k") and gpu[3][3][6] is mu and va[0] == ("input", "v")
        name, grid, block, args, smem = gpu[-1]
        if engine == "wgmma":
            assert name == f"nvfp4_attn_fwd_sm90<__half, 64, 4, true{', 16' if causal else ''}>"
            assert grid == (7, 4, 2) and block == (128,) and smem == nvfp4.fwd_smem_bytes(64, 4, "wgmma") == 63048
            assert args[6] == np.int32(512)  # (V^T rows of 1024 tokens: 512 code bytes, no padding needed)
        else:
            assert name == f"nvfp4_attn_fwd<__half, {d}, 8, true>"
            assert grid == (4, 4, 2) and block == (256,) and smem == nvfp4.fwd_smem_bytes(d, 8)
        # Q's, K's and V's bytes (and scales), then qmk, from the quantizers above
        assert args[:6] == (gpu[2][3][8], gpu[2][3][9], gpu[3][3][8], gpu[3][3][9], gpu[4][3][7], gpu[4][3][8])
        assert args[7 if engine == "wgmma" else 6] is gpu[2][3][-1]
        assert args[-2:] == (np.int32(-1), np.int32(0 if causal else -1))  # the kernel window (left, right)


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


def test_nvfp4_tail_split_launch(gpu, monkeypatch):
    """The tail split (non-causal, two-level P): the call zeroes the parts' counters first; the warp-specialized
    kernel's split instance gets a 1-D grid (whole items, then every part of the rest) and (whole, nsplit, nblk, the
    partials' scratch, the counters) after the whole-item instance's arguments, which gets (0, 1, 1, null, null)
    there. Causal calls and single-level P keep whole items."""
    from sagecupy import nvfp4
    from sagecupy.config import NVFP4Config

    monkeypatch.setattr(nvfp4, "_zero_ints", lambda c: gpu.append(("zero", c)) or ())
    # B 2 x Hq 4 x 3 blocks of 192 rows = 24 items: on 8 SMs whole waves (no split); on 7 SMs 21 whole, the other 3
    # in 2 parts of their 16 key tiles (6 parts on 7 SMs: the tail takes 1/2 an item's time; 4 parts the same, 3
    # parts 2/3)
    q, k, v = _inputs(nq=400, nk=1024)
    names = dict(q=q, k=k, v=v)
    nvfp4._ATTN_PLANS.clear()
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 8)
    nvfp4.attention(q, k, v)
    plain = list(gpu)
    assert not any(x[0] == "zero" for x in plain)
    name, grid, block, args, smem = plain[-1]
    assert name == "nvfp4_attn_fwd_ws_img<__half, 128, true, 1, 3, false, false>" and grid == (3, 4, 2)
    assert args[-5:] == (np.int32(0), np.int32(1), np.int32(1), None, None)
    del gpu[:]
    nvfp4._ATTN_PLANS.clear()  # (the SM count is not part of a plan's key)
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 7)
    for _ in range(2):  # recorded, then replayed
        start = len(gpu)
        nvfp4.attention(q, k, v)
        run = gpu[start:]
        assert run[0][0] == "zero" and [x[0] for x in run[1:]] == [x[0] for x in plain[:-1]] + [
            "nvfp4_attn_fwd_ws_img<__half, 128, true, 1, 3, false, true>"]
        counters = run[0][1]
        assert counters.shape == (3 * 12,) and counters.dtype == np.int32
        name, grid, block, args, smem = run[-1]
        assert grid == (21 + 3 * 2,) and block == (512,) and smem == nvfp4.ws_smem_bytes(128) == plain[-1][4]
        assert args[-5:-2] == (np.int32(21), np.int32(2), np.int32(3)) and args[-1] is counters
        assert isinstance(args[-2], np.uint64)  # (the partials: scratch in the call's arena)
        a, pk = _summary(run[-1], names)[3][:-5], _summary(plain[-1], names)[3][:-5]
        assert a[:8] == pk[:8] and a[9:] == pk[9:]  # (all but the images' address, an offset in another arena)
    del gpu[:]
    for kw in (dict(causal=True), dict(config=NVFP4Config(two_level_p=False))):
        nvfp4.attention(q, k, v, **kw)
        assert gpu[-1][0].startswith("nvfp4_attn_fwd_ws_img<") and gpu[-1][0].endswith(", false>")
        assert not any(x[0] == "zero" for x in gpu)


def _ws_img_kernel_check(run, names, causal=False):
    """The warp-specialized kernel's launch (the last of ``run``): Q's bytes and scales, null arguments where its
    signature has the raw Q, its strides and K's mean, sm_scale, the K/V stage images (what the launch before wrote),
    qmk; O, the LSE and the sizes; one 192-row item per CTA, 512 threads, NvWs<128, 3>::SMEM."""
    from sagecupy import nvfp4

    name, grid, block, args, smem = run[-1]
    assert name == f"nvfp4_attn_fwd_ws_img<__half, 128, true, {16 if causal else 1}, 3, false, false>"
    assert grid == (3, 4, 2) and block == (512,) and smem == nvfp4.ws_smem_bytes(128)
    assert args[8] == run[-2][3][-1]  # (the images: their arena address, what the launch before wrote)
    a = _summary(run[-1], names)[3]
    assert a[2:8] == (None, ("int64", 0), ("int64", 0), ("int64", 0), None, ("float32", 0.125))
    assert a[10][0] == "array" and a[10][1:] == ((2, 4, 400, 128), "<f2") and a[14][1:] == ((2, 4, 400), "<f4")
    assert a[15:23] == (("int32", 4), ("int32", 2), ("int32", 400), ("int32", 1024), ("int32", 1024),
                        ("float32", np.float32(0.125 * nvfp4.LOG2E).item()),
                        ("int32", -1), ("int32", 0 if causal else -1))  # (the kernel window (left, right))
    assert a[-5:] == (("int32", 0), ("int32", 1), ("int32", 1), None, None)
    return a


@pytest.mark.parametrize("causal", [False, True])
def test_nvfp4_kv_images_launch(gpu, causal, monkeypatch):
    """D=128 on the wgmma engine. attention: K's mean, Q's quantizer (with qmk), then nvfp4_kv_images_raw (grid: key
    tiles, Hkv, B; 128 threads; its dynamic shared memory) on the raw K and V with their strides and the mean,
    writing a scratch buffer in the call's arena (no K or V quantizer); attention_packed: nvfp4_kv_images on the
    packed K and V. Then the warp-specialized kernel on the images (:func:`_ws_img_kernel_check`)."""
    from sagecupy import nvfp4

    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 8)  # (24 items: whole waves, no tail split)
    q, k, v = _inputs(nq=400, nk=1024)  # B 2, Hq 4, Hkv 2; 16 key tiles (a partial last tile needs V padded, which
    # the fake arrays cannot: the GPU test has one)
    names = dict(q=q, k=k, v=v)
    nvfp4.attention(q, k, v, sm_scale=0.125, causal=causal)
    run = list(gpu)
    assert [x[0] for x in run] == ["column_partial<__half, 128, false>", "column_finish<false>",
                                   "nvfp4_quant_rows<__half, 128>", "nvfp4_kv_images_raw<__half, 128>",
                                   run[-1][0]]
    mu, qq = run[1][3][-1], run[2][3]
    assert qq[0] is q and qq[10] is mu  # (Q's quantizer: the dot with K's mean gives qmk)
    iname, igrid, iblock, iargs, ismem = run[-2]
    assert igrid == (16, 2, 2) and iblock == (128,)
    assert ismem == nvfp4.ws_img_raw_smem_bytes(128) == 32768 + 64 * 136 * 2 + 512
    ia = _summary(run[-2], names)[3]
    assert len(ia) == 12 and ia[0] == ("input", "k") and ia[5] == ("input", "v") and iargs[4] is mu
    assert ia[1:4] == tuple(("int64", k.strides[i] // 2) for i in (0, 1, 2))
    assert ia[6:9] == tuple(("int64", v.strides[i] // 2) for i in (0, 1, 2))
    assert ia[9:11] == (("int32", 1024), ("int32", 1024)) and isinstance(iargs[-1], np.uint64)
    a = _ws_img_kernel_check(run, names, causal)
    assert run[-1][3][:2] == (qq[8], qq[9]) and run[-1][3][9] is qq[-1]  # (Q's bytes, scales and qmk)
    del gpu[:]
    nvfp4.attention(q, k, v, sm_scale=0.125, causal=causal)  # (replayed: the same launches)
    assert [x[0] for x in gpu] == [x[0] for x in run]
    # attention_packed: the images from the packed K and V
    packed = {n: FakeArray(sh, np.uint8) for n, sh in (
        ("q_packed", (2, 4, 400, 64)), ("q_scales", (2, 4, 400, 8)), ("k_packed", (2, 2, 1024, 64)),
        ("k_scales", (2, 2, 1024, 8)), ("v_packed", (2, 2, 128, 512)), ("v_scales", (2, 2, 128, 64)))}
    names.update(packed)
    del gpu[:]
    nvfp4.attention_packed(packed, sm_scale=0.125, causal=causal)
    assert len(gpu) == 2
    iname, igrid, iblock, iargs, _ = gpu[0]
    assert iname == "nvfp4_kv_images<128>" and igrid == (16, 2, 2) and iblock == (128,)
    assert _summary(gpu[0], names)[3][:7] == (("input", "k_packed"), ("input", "k_scales"), ("input", "v_packed"),
                                              ("input", "v_scales"), ("int32", 512), ("int32", 1024), ("int32", 1024))
    a = _ws_img_kernel_check(gpu, names, causal)
    assert a[:2] == (("input", "q_packed"), ("input", "q_scales")) and a[9] is None  # (no lse_offset: no qmk)


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_qat_launches(gpu, engine, monkeypatch):
    """qat.forward: fake quantization of Q, K (rows) and V (tokens, transposed), then the engine's forward kernel
    (wgmma: two warpgroups, the causal dispatch group; mma.sync: 8 warps) on them, 128 query rows per CTA;
    qat.backward: delta from dO and O', then the dK/dV and dQ kernels of the engine."""
    from sagecupy import qat

    monkeypatch.setattr(FakeArray, "transpose", lambda self, *ax: FakeArray(  # (the mma.sync backward's V~ view)
        [self.shape[i] for i in ax], self.dtype, [self.strides[i] for i in ax], self.data.ptr), raising=False)
    q, k, v = _inputs(nq=128, nk=128)  # (padded lengths: the fake arrays cannot zero a padding)
    for causal in (False, True):
        del gpu[:]
        o, res = qat.forward(q, k, v, causal=causal, engine=engine)
        assert [x[0] for x in gpu[:3]] == ["nvfp4_fq_rows<__half>", "nvfp4_fq_rows<__half>", "nvfp4_fq_tokens<__half>"]
        name, grid, block, args, smem = gpu[-1]
        fq = [x[3][-2] for x in gpu[:3]]  # (the fp16 operands the fake-quantization kernels wrote)
        assert args[:3] == tuple(fq) and (res.q_t, res.k_t, res.vt_t) == tuple(fq)
        if engine == "wgmma":
            assert name == f"qat_attn_fwd_sm90<__half, 128{', 16' if causal else ''}>"
        else:
            assert name == "qat_attn_fwd<__half, 128, 8>"
        assert grid == (1, 4, 2) and block == (256,) and args[-2:] == (np.int32(-1), np.int32(0 if causal else -1))
        do = FakeArray(q.shape, np.float16)
        del gpu[:]
        qat.backward(res, do, engine=engine)
        sfx = "_sm90" if engine == "wgmma" else ""
        assert [x[0] for x in gpu] == ["qat_delta<__half>", f"qat_attn_bwd{sfx}<__half, 128>",
                                       f"qat_attn_bwd_dq{sfx}<__half, 128>"]
        assert gpu[0][3][0] is do and gpu[0][3][4] is res.o_prime
        assert gpu[1][1:3] == ((2, 2, 2), (128,)) and gpu[2][1:3] == ((2, 4, 2), (128,))


def test_int8_mma_backward_at_d64_fits_two_ctas_per_sm_on_100kb_gpus():
    """sm_86, sm_89 and sm_120 have 100 KiB of shared memory per SM (1 KiB of it reserved per block): the mma.sync
    backward kernels at D = 64 must fit two CTAs per SM under every (dv_int8, ds_int8) pair, the default's bf16 Q
    tile included (it takes the bytes of the transposed codes the 16-bit products do not read)."""
    from sagecupy import int8

    for _, ds_int8 in int8._BWD_MODES:
        for smem in int8.bwd_smem(64, "mma", ds_int8):
            assert 2 * (smem + 1024) <= 100 * 1024, (ds_int8, smem)
