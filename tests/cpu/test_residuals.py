"""int8.backward and qat.backward check every residual against the problem it claims (int8.check_residuals,
qat.check_residuals) before any launch: the kernels index the residuals from the problem's sizes, so a residual of
another problem would make them read past its end. Runs on the stand-in cupy of test_host_paths (no GPU)."""
import dataclasses

import numpy as np
import pytest

from test_host_paths import FakeArray, _arena_base, _inputs, _summary, gpu  # noqa: F401  (gpu: the fixture)

@pytest.fixture(autouse=True)
def _fresh_plans(gpu):
    """Recorded programs hold the kernels of the test that recorded them (each test's stand-ins log to its own
    list): start every test without any."""
    from sagecupy import int8, nvfp4

    for plans in (int8._FWD_PLANS, int8._BWD_PLANS, nvfp4._ATTN_PLANS):
        plans.clear()


INT8_ARRAYS = ("q_codes", "q_scale", "k_codes", "k_scale", "lse2", "mu_k", "v", "o")
QAT_ARRAYS = ("q_t", "k_t", "vt_t", "o_prime", "lse2")


def _same_metadata(x):
    """A new array (a new address) with x's shape, dtype and strides: what a residual of the same problem is."""
    return FakeArray(x.shape, x.dtype, x.strides)


def _corrupt(x, how):
    """x with one property changed (an array the kernels would misread), and the words its error names."""
    if how == "shape":
        return FakeArray(x.shape[:-1] + (x.shape[-1] + 16,), x.dtype), r"\.shape=.* must be"
    if how == "dtype":
        return FakeArray(x.shape, np.float64), r"\.dtype=float64 must be"
    if how == "strides":  # every row twice as far apart as its length: not C-contiguous
        return FakeArray(x.shape, x.dtype, x.strides[:-2] + (2 * x.strides[-2], x.strides[-1])), "contiguous"
    if how == "last-dim":
        return FakeArray(x.shape, x.dtype, tuple(2 * s for s in x.strides)), "contiguous"
    if how == "alignment":
        return FakeArray(x.shape, x.dtype, x.strides, ptr=x.data.ptr + 2), "16-byte aligned"
    if how == "device":
        y = _same_metadata(x)
        y.data.device_id = 1
        return y, "device 1"
    if how == "host":
        return np.zeros(x.shape, x.dtype), "must be a CuPy array"
    raise AssertionError(how)


def _int8_call(nq=100, nk=70, **kw):
    from sagecupy import int8

    q, k, v = _inputs(nq=nq, nk=nk)
    o, res = int8.forward(q, k, v, causal=True, **kw)
    return res, FakeArray(q.shape, q.dtype)


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_int8_valid_residuals_pass_and_launch_the_same(gpu, engine):
    """Residuals as the forward made them pass; a copy of them at new addresses (the same metadata) replays the same
    launches on its own arrays; mu_k left out (as the torch adapter does: the backward does not read it) too."""
    from sagecupy import int8

    res, do = _int8_call()
    runs = []
    for r in (res, dataclasses.replace(res, **{n: _same_metadata(getattr(res, n)) for n in INT8_ARRAYS}),
              dataclasses.replace(res, mu_k=None)):
        int8.check_residuals(r)
        start = len(gpu)
        int8.backward(r, do, engine=engine)
        launches = gpu[start:]
        names = {"do": do, **{n: getattr(r, n) for n in INT8_ARRAYS if getattr(r, n) is not None}}
        runs.append([_summary(x, names, _arena_base(launches)) for x in launches])
    assert runs[0] == runs[1] == runs[2]
    # the pre-passes (the mma.sync engine's default, 16-bit dV, dK and dQ: delta alone), the dK/dV and dQ kernels
    assert len(runs[0]) == (4 if engine == "wgmma" else 3)
    # the residuals reach the kernels by name (not some other array of their shape)
    used = {a[1] for launch in runs[0] for a in launch[3] if isinstance(a, tuple) and a[0] == "input"}
    assert {"q_codes", "k_codes", "q_scale", "k_scale", "lse2", "o", "do"} <= used


def test_int8_residuals_of_another_problem_are_refused(gpu):
    """A residual made for Nq = 128 used with the problem of Nq = 1000 (or the reverse) is refused before any
    launch, naming the first array that does not fit; so is a mix of two calls' arrays."""
    from sagecupy import int8

    res128, do128 = _int8_call(nq=128, nk=128)
    res1000, do1000 = _int8_call(nq=1000, nk=1000)
    res100, _ = _int8_call(nq=100, nk=128)
    start = len(gpu)
    with pytest.raises(ValueError, match=r"residuals\.q_codes\.shape=\(2, 4, 128, 128\) must be \(2, 4, 1024, 128\)"):
        int8.backward(dataclasses.replace(res128, problem=res1000.problem), do1000)
    with pytest.raises(ValueError, match=r"residuals\.q_codes\.shape=\(2, 4, 1024, 128\) must be \(2, 4, 128, 128\)"):
        int8.backward(dataclasses.replace(res1000, problem=res128.problem), do128)
    for field in ("q_scale", "k_codes", "k_scale", "lse2", "v", "o"):  # (mu_k: (B, Hkv, D), the same for both)
        with pytest.raises(ValueError, match=rf"residuals\.{field}\.shape="):
            int8.backward(dataclasses.replace(res1000, **{field: getattr(res128, field)}), do1000)
    # the same padded sizes (Nq 100 and 128 both pad to 128 rows): the output's own shape tells them apart
    with pytest.raises(ValueError, match=r"residuals\.o\.shape=\(2, 4, 100, 128\) must be \(2, 4, 128, 128\)"):
        int8.backward(dataclasses.replace(res128, o=res100.o), do128)
    assert len(gpu) == start  # nothing launched


@pytest.mark.parametrize("field", INT8_ARRAYS)
@pytest.mark.parametrize("how", ["shape", "dtype", "strides", "alignment", "device", "host"])
def test_int8_each_corrupted_residual_is_refused_by_name(gpu, field, how):
    """Each residual array corrupted in turn (after a valid call recorded the backward's plan: the replay path checks
    too) is refused with its name and what was wrong, and nothing is launched."""
    from sagecupy import int8

    res, do = _int8_call()
    int8.backward(res, do)
    bad, words = _corrupt(getattr(res, field), how)
    if how == "strides" and field in ("v", "o"):
        # V and O are read by rows at their own strides: rows further apart are fine while they stay aligned
        int8.check_residuals(dataclasses.replace(res, **{field: bad}))
        bad, words = _corrupt(getattr(res, field), "last-dim")
    start = len(gpu)
    with pytest.raises((TypeError, ValueError), match=rf"residuals\.{field}\b.*{words}|residuals\.{field}{words}"):
        int8.backward(dataclasses.replace(res, **{field: bad}), do)
    assert len(gpu) == start


def test_int8_residual_problem_and_config_are_checked(gpu):
    from sagecupy import int8
    from sagecupy.config import SageBwdConfig

    res, do = _int8_call()
    # (no backward call first: a Problem equal by value to a checked one, nq=100.0 for 100, would share its plan,
    # whose launches are the same)
    p = res.problem
    bad_problems = [
        (dict(nq=100.0), TypeError, r"residuals\.problem\.nq must be an int"),
        (dict(batch=True), TypeError, r"residuals\.problem\.batch must be an int"),
        (dict(heads_kv=0), ValueError, r"residuals\.problem\.heads_kv=0 must be at least 1"),
        (dict(heads_kv=3), ValueError, r"residuals\.problem: heads_q=4 must be a multiple of heads_kv=3"),
        (dict(head_dim=96), ValueError, r"residuals\.problem\.head_dim=96"),
        (dict(dtype="float32"), ValueError, r"residuals\.problem\.dtype='float32'"),
        (dict(layout="BHND"), ValueError, r"residuals\.problem\.layout='BHND'"),
        (dict(causal=1), TypeError, r"residuals\.problem\.causal must be a bool"),
        (dict(sm_scale=float("nan")), ValueError, r"residuals\.problem\.sm_scale=nan"),
        (dict(sm_scale=-0.1), ValueError, r"residuals\.problem\.sm_scale=-0\.1"),
        (dict(nk=1 << 24), ValueError, r"residuals\.problem: Nk=16777216 exceeds the kernels' limit of 16777088"),
    ]
    start = len(gpu)
    for changes, exc, words in bad_problems:
        with pytest.raises(exc, match=words):
            int8.backward(dataclasses.replace(res, problem=dataclasses.replace(p, **changes)), do)
    with pytest.raises(TypeError, match=r"residuals\.problem must be a sagecupy\._checks\.Problem, got dict"):
        int8.backward(dataclasses.replace(res, problem=dataclasses.asdict(p)), do)
    with pytest.raises(TypeError, match=r"residuals\.config must be a SageBwdConfig, got str"):
        int8.backward(dataclasses.replace(res, config="default"), do)
    with pytest.raises(ValueError, match=r"residuals\.config: q_smoothing=True"):
        int8.backward(dataclasses.replace(res, config=SageBwdConfig(q_smoothing=True)), do)
    with pytest.raises(ValueError, match=r"residuals\.config: ds_int8=False needs dv_int8=False"):
        int8.backward(dataclasses.replace(res, config=SageBwdConfig(dv_int8=True)), do)
    with pytest.raises(TypeError, match="residuals must be the Residuals returned by sagecupy.int8.forward"):
        int8.backward(dataclasses.asdict(res), do)
    assert len(gpu) == start


def test_int8_nhd_and_gqa_residuals(gpu):
    """The expected shapes follow the problem's layout (V and O in NHD) and its kv heads."""
    from sagecupy import int8

    q, k, v = _inputs(layout="NHD", nq=300, nk=130)
    _, res = int8.forward(q, k, v, layout="NHD")
    do = FakeArray(q.shape, q.dtype)
    int8.backward(res, do)
    assert res.k_codes.shape == (2, 2, 256, 128) and res.q_codes.shape == (2, 4, 384, 128)
    with pytest.raises(ValueError, match=r"residuals\.v\.shape=\(2, 2, 130, 128\) must be \(2, 130, 2, 128\)"):
        int8.backward(dataclasses.replace(res, v=FakeArray((2, 2, 130, 128), np.float16)), do)


def _qat_call(nq=128, nk=128, engine="wgmma"):
    from sagecupy import qat

    q, k, v = _inputs(nq=nq, nk=nk)  # (padded lengths: the fake arrays cannot zero a padding)
    o, res = qat.forward(q, k, v, engine=engine)
    return res, FakeArray(q.shape, q.dtype)


def test_qat_valid_residuals_pass_and_launch_the_same(gpu):
    from sagecupy import qat

    res, do = _qat_call()
    runs = []
    for r in (res, dataclasses.replace(res, **{n: _same_metadata(getattr(res, n)) for n in QAT_ARRAYS})):
        start = len(gpu)
        qat.backward(r, do, engine="wgmma")
        names = {"do": do, **{n: getattr(r, n) for n in QAT_ARRAYS}}
        runs.append([_summary(x, names) for x in gpu[start:]])
    assert runs[0] == runs[1] and [x[0] for x in runs[0]] == [
        "qat_delta<__half>", "qat_attn_bwd_sm90<__half, 128>", "qat_attn_bwd_dq_sm90<__half, 128>"]


def test_qat_residuals_of_another_problem_are_refused(gpu):
    from sagecupy import qat

    res128, do128 = _qat_call(nq=128, nk=128)
    res256, do256 = _qat_call(nq=256, nk=256)
    start = len(gpu)
    with pytest.raises(ValueError, match=r"residuals\.q_t\.shape=\(2, 4, 128, 128\) must be \(2, 4, 256, 128\)"):
        qat.backward(dataclasses.replace(res128, problem=res256.problem), do256)
    for field in QAT_ARRAYS[1:]:
        with pytest.raises(ValueError, match=rf"residuals\.{field}\.shape="):
            qat.backward(dataclasses.replace(res256, **{field: getattr(res128, field)}), do256)
    assert len(gpu) == start


@pytest.mark.parametrize("field", QAT_ARRAYS)
@pytest.mark.parametrize("how", ["shape", "dtype", "strides", "alignment", "device", "host"])
def test_qat_each_corrupted_residual_is_refused_by_name(gpu, field, how):
    from sagecupy import qat

    res, do = _qat_call()
    bad, words = _corrupt(getattr(res, field), how)
    start = len(gpu)
    with pytest.raises((TypeError, ValueError), match=rf"residuals\.{field}\b.*{words}|residuals\.{field}{words}"):
        qat.backward(dataclasses.replace(res, **{field: bad}), do)
    assert len(gpu) == start


def test_qat_residual_problem_and_config_are_checked(gpu):
    from sagecupy import qat
    from sagecupy.config import DEFAULT, QATConfig

    res, do = _qat_call()
    with pytest.raises(ValueError, match=r"residuals\.problem\.nq=0 must be at least 1"):
        qat.backward(dataclasses.replace(res, problem=dataclasses.replace(res.problem, nq=0)), do)
    with pytest.raises(TypeError, match=r"residuals\.config must be a QATConfig, got SageBwdConfig"):
        qat.backward(dataclasses.replace(res, config=DEFAULT), do)
    for cfg, words in ((QATConfig(block_kv=64.0), "block_kv=64.0 must be an int"),
                       (QATConfig(two_level_p=1), "two_level_p=1 must be a bool"),
                       (QATConfig(two_level_p=False), "two_level_p=False is reference-only")):
        with pytest.raises(ValueError, match=rf"residuals\.config: {words}"):
            qat.backward(dataclasses.replace(res, config=cfg), do)
    # QAT takes no packed sequences: a THD problem would make its kernels index dense buffers with packed strides
    with pytest.raises(ValueError, match=r"residuals\.problem\.layout='THD' is not supported; supported: "
                                         r"\('HND', 'NHD'\)"):
        qat.backward(dataclasses.replace(res, problem=dataclasses.replace(res.problem, layout="THD")), do)
    # bf16: the operands are bf16 bits (uint16); fp16 operands of the same shape are refused
    bf = dataclasses.replace(res, problem=dataclasses.replace(res.problem, dtype="bfloat16"))
    with pytest.raises(TypeError, match=r"residuals\.q_t\.dtype=float16 must be uint16"):
        qat.backward(bf, FakeArray(do.shape, np.uint16))
