"""The chunked exact attention (``attention_chunked``: key and query blocks, online softmax in float64) against the
dense one, its memory, and the memory limit of the dense reference computations (``check_memory``, the simulators'
``peak_bytes``)."""
import tracemalloc
import warnings

import numpy as np
import pytest

from sagecupy.config import DEFAULT, NVFP4Config, PAPER, QATConfig
from sagecupy.reference import attention as A
from sagecupy.reference import nvfp4 as RN
from sagecupy.reference import qat as RQ
from sagecupy.reference import sagebwd as RS


def _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout="HND", scale=1.0):
    rng = np.random.default_rng(seed)
    q = scale * rng.standard_normal((B, Hq, Nq, D))
    k = scale * rng.standard_normal((B, Hkv, Nk, D))
    v = rng.standard_normal((B, Hkv, Nk, D))
    do = rng.standard_normal((B, Hq, Nq, D))
    if layout == "NHD":
        q, k, v, do = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v, do))
    return q, k, v, do


def _rel(a, b):
    """max |a - b| / max |b| (1 where b is all zeros and a is not)."""
    den = np.abs(b).max()
    return np.abs(a - b).max() / den if den > 0 else float(np.abs(a).max() > 0)


# (B, Hq, Hkv, Nq, Nk, D, causal, layout, block_q, block_k)
CASES = [
    (1, 2, 2, 37, 37, 8, False, "HND", 5, 7),
    (1, 2, 2, 37, 37, 8, True, "HND", 5, 7),
    (2, 4, 2, 23, 61, 16, True, "HND", 8, 16),    # Nq < Nk, GQA
    (1, 6, 2, 61, 23, 16, True, "HND", 7, 5),     # Nq > Nk: 38 rows see no key; GQA
    (1, 3, 1, 50, 9, 4, True, "NHD", 16, 3),      # MQA, rows without keys, NHD
    (2, 2, 1, 19, 33, 12, False, "NHD", 1024, 1024),  # one block
    (1, 1, 1, 1, 1, 2, True, "HND", 1, 1),
    (1, 2, 2, 40, 40, 8, True, "HND", 3, 40),     # blocks of unequal sizes, causal
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}-{}-{}-b{}x{}".format(
    *c[:6], "causal" if c[6] else "full", *c[7:]))
def test_chunked_equals_dense(case):
    B, Hq, Hkv, Nq, Nk, D, causal, layout, bq, bk = case
    q, k, v, do = _inputs(1, B, Hq, Hkv, Nq, Nk, D, layout, scale=2.0)
    dense = A.attention_intermediates(q, k, v, do, causal=causal, layout=layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (rows that see no key: no floating-point warning)
        chunked = A.attention_chunked(q, k, v, do, causal=causal, layout=layout, block_q=bq, block_k=bk)
    assert set(chunked) == {"O", "lse", "delta", "dQ", "dK", "dV"}
    for key in ("O", "delta", "dQ", "dK", "dV"):
        assert chunked[key].shape == dense[key].shape, key
        assert _rel(chunked[key], dense[key]) <= 1e-12, key
    seen = np.isfinite(dense["lse"])
    assert np.array_equal(np.isfinite(chunked["lse"]), seen)
    assert np.all(chunked["lse"][~seen] == -np.inf)
    assert _rel(chunked["lse"][seen], dense["lse"][seen]) <= 1e-12
    # a row that sees no key: O = 0 and zero gradients, exactly
    assert np.all(chunked["O"][~seen] == 0) and np.all(chunked["dQ"][~seen] == 0)


@pytest.mark.parametrize("case", CASES[:6], ids=str)
def test_chunked_forward_and_backward_in_the_callers_layout(case):
    B, Hq, Hkv, Nq, Nk, D, causal, layout, bq, bk = case
    q, k, v, do = _inputs(2, B, Hq, Hkv, Nq, Nk, D, layout)
    o, lse = A.attention_forward(q, k, v, causal=causal, layout=layout)
    oc, lsec = A.attention_forward_chunked(q, k, v, causal=causal, layout=layout, block_q=bq, block_k=bk)
    assert oc.shape == o.shape and _rel(oc, o) <= 1e-12
    assert np.array_equal(np.isfinite(lsec), np.isfinite(lse))
    grads = A.attention_backward(q, k, v, o, lse, do, causal=causal, layout=layout)
    chunked = A.attention_backward_chunked(q, k, v, o, lse, do, causal=causal, layout=layout, block_q=bq, block_k=bk)
    for g, gc in zip(grads, chunked):
        assert gc.shape == g.shape and _rel(gc, g) <= 1e-12


def test_chunked_arguments_are_checked():
    q, k, v, do = _inputs(0, 1, 2, 2, 8, 8, 4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block_q"):
            A.attention_chunked(q, k, v, block_q=bad)
        with pytest.raises(ValueError, match="block_k"):
            A.attention_chunked(q, k, v, block_k=bad)
    with pytest.raises(TypeError, match="causal"):
        A.attention_chunked(q, k, v, causal=1)
    with pytest.raises(ValueError, match="do"):
        A.attention_chunked(q, k, v, do[:, :1])
    with pytest.raises(ValueError, match="lse"):
        A.attention_backward_chunked(q, k, v, q, np.zeros((1, 2, 7)), do)


def _peak(fn):
    """Peak bytes NumPy allocates while ``fn`` runs (tracemalloc traces NumPy's data buffers)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_chunked_memory_is_bounded_by_blocks_not_by_n_squared():
    """At N = 2000 one (N, N) float64 matrix is 32 MB; the chunked forward and backward stay below a quarter of it
    (inputs, outputs and a few 256 x 256 blocks), while the dense forward alone holds several such matrices."""
    N, D = 2000, 8
    q, k, v, do = _inputs(3, 1, 1, 1, N, N, D)
    one_matrix = 8 * N * N
    chunked = _peak(lambda: A.attention_chunked(q, k, v, do, block_q=256, block_k=256))
    assert chunked < one_matrix / 4
    assert _peak(lambda: A.attention_forward(q, k, v)) > 2 * one_matrix


# --------------------------------------------------------------------------------------------------
# the memory limit of the dense computations
# --------------------------------------------------------------------------------------------------

# (B, Hq, Hkv, Nq, Nk, D, causal): multi-head, GQA, tile padding, tiny Nk, Nq > Nk
SHAPES = [(1, 2, 1, 256, 320, 16, False), (2, 2, 2, 100, 220, 16, True), (1, 3, 1, 100, 5, 16, True),
          (1, 4, 2, 128, 128, 32, True)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_peak_bytes_bound_the_measured_peaks(shape):
    """Each dense computation's estimate (what it compares with MEMORY_LIMIT) is at least what it allocates at its
    peak, and, where the (N, N) matrices dominate, not more than 4x that (a limit that refuses what would fit
    would be as wrong as one that lets a machine run out of memory)."""
    B, Hq, Hkv, Nq, Nk, D, causal = shape
    q, k, v, do = _inputs(4, B, Hq, Hkv, Nq, Nk, D)
    dominated = min(Nq, Nk) >= 64  # (else the tile padding of the keys, or the (N, D) arrays, dominate)
    checks = []

    o, lse = A.attention_forward(q, k, v, causal=causal)
    checks.append(("attention_forward", _peak(lambda: A.attention_forward(q, k, v, causal=causal)),
                   A.dense_peak_bytes(B, Hq, Nq, Nk, D, kind="forward")))
    checks.append(("attention_backward", _peak(lambda: A.attention_backward(q, k, v, o, lse, do, causal=causal)),
                   A.dense_peak_bytes(B, Hq, Nq, Nk, D, kind="backward")))
    checks.append(("attention_intermediates", _peak(lambda: A.attention_intermediates(q, k, v, do, causal=causal)),
                   A.dense_peak_bytes(B, Hq, Nq, Nk, D, kind="intermediates")))
    for cfg in (DEFAULT, PAPER):
        _, res = RS.forward(q, k, v, causal=causal, config=cfg)
        step = max(_peak(lambda: RS.forward(q, k, v, causal=causal, config=cfg)), _peak(lambda: RS.backward(res, do)))
        checks.append((f"sagebwd {cfg.name}", step, RS.peak_bytes(B, Hq, Nq, Nk, D, cfg)))
        checks.append((f"sagebwd.run {cfg.name}", _peak(lambda: RS.run(q, k, v, do, causal=causal, config=cfg)),
                       RS.peak_bytes(B, Hq, Nq, Nk, D, cfg, intermediates=True)))
    for cfg in (NVFP4Config(), NVFP4Config(two_level_p=False), NVFP4Config(quantize=False)):
        checks.append((f"nvfp4 {cfg}", _peak(lambda: RN.forward(q, k, v, causal=causal, config=cfg,
                                                                  return_intermediates=True)),
                       RN.peak_bytes(B, Hq, Nq, Nk, D, cfg)))
    for cfg in (QATConfig(), QATConfig(two_level_p=False)):
        _, res = RQ.forward(q, k, v, causal=causal, config=cfg)
        step = max(_peak(lambda: RQ.forward(q, k, v, causal=causal, config=cfg, return_intermediates=True)),
                   _peak(lambda: RQ.backward(res, do)))
        checks.append((f"qat {cfg}", step, RQ.peak_bytes(B, Hq, Nq, Nk, D, cfg)))
    for name, measured, estimate in checks:
        assert measured <= estimate, (name, measured, estimate)
        if dominated and "quantize=False" not in name:
            assert estimate <= 4 * measured, (name, measured, estimate)


def test_dense_computations_refuse_above_the_limit(monkeypatch):
    """Below the limit nothing changes; above it every dense computation raises a ValueError that says what it
    would need and the limit, before any (N, N) array exists; the chunked form runs regardless."""
    q, k, v, do = _inputs(5, 1, 2, 2, 64, 64, 16)
    o, lse = A.attention_forward(q, k, v)
    _, res_s = RS.forward(q, k, v)
    _, res_q = RQ.forward(q, k, v)
    monkeypatch.setattr(A, "MEMORY_LIMIT", 64 * 1024)
    calls = [
        ("dense exact attention", lambda: A.attention_forward(q, k, v)),
        ("dense exact attention backward", lambda: A.attention_backward(q, k, v, o, lse, do)),
        ("the exact intermediates", lambda: A.attention_intermediates(q, k, v, do)),
        ("the float64 SageBwd simulator", lambda: RS.forward(q, k, v)),
        ("the float64 SageBwd simulator", lambda: RS.backward(res_s, do)),
        ("the float64 SageBwd simulator", lambda: RS.run(q, k, v, do)),
        ("the float64 NVFP4 simulator", lambda: RN.forward(q, k, v)),
        ("the float64 QAT simulator", lambda: RQ.forward(q, k, v)),
        ("the float64 QAT simulator", lambda: RQ.backward(res_q, do)),
    ]
    words = (r"would need about [0-9.]+ GiB of memory, more than the reference's limit of 0\.0 GiB "
             r"\(sagecupy\.reference\.attention\.MEMORY_LIMIT\)")
    for what, call in calls:
        with pytest.raises(ValueError, match=words) as e:
            call()
        assert str(e.value).startswith(what)
    chunked = A.attention_chunked(q, k, v, do)
    assert _rel(chunked["O"], o) <= 1e-12
