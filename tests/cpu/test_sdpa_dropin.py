"""The drop-in scaled_dot_product_attention's decision (sagecupy.adapters.dropin) on fake tensors, without PyTorch.

Each call either runs the kernels (None) or names why not; PyTorch's semantics decide: top-left is_causal, GQA only
with enable_gqa, any attn_mask or dropout -> PyTorch."""
import warnings
from dataclasses import dataclass

import pytest

from sagecupy.adapters import dropin


@dataclass(frozen=True)
class Device:
    type: str = "cuda"
    index: int = 0


@dataclass
class Fake:
    """The metadata the decision reads: shape, dtype, device."""
    shape: tuple
    dtype: str = "bfloat16"
    device: Device = Device()


def qkv(B=2, Hq=8, Hkv=8, Nq=256, Nk=256, D=128, dtype="bfloat16", device=Device()):
    return (Fake((B, Hq, Nq, D), dtype, device), Fake((B, Hkv, Nk, D), dtype, device),
            Fake((B, Hkv, Nk, D), dtype, device))


def reason(*tensors, **kw):
    return dropin.unsupported_reason(*tensors, **kw)


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(scale=0.05), dict(family="qat"),
                                dict(family="nvfp4"), dict(is_causal=True, family="int8", grad_needed=True)])
@pytest.mark.parametrize("shape", [dict(), dict(D=64, dtype="float16"), dict(Hq=8, Hkv=2), dict(Nq=1, Nk=300),
                                   dict(Nq=300, Nk=77)])
def test_supported_calls(shape, kw):
    """fp16/bf16, D 64/128, MHA or GQA with enable_gqa, Nq != Nk without is_causal, any family without grad."""
    q, k, v = qkv(**shape)
    gqa = shape.get("Hkv", 8) != shape.get("Hq", 8)
    causal_ok = shape.get("Nq", 256) == shape.get("Nk", 256)
    got = reason(q, k, v, enable_gqa=gqa, **kw)
    if kw.get("is_causal") and not causal_ok:
        assert "top-left" in got  # test_top_left_causal_needs_square
    else:
        assert got is None


CASES = [
    # (what, qkv kwargs, call kwargs, words the reason must hold)
    ("mask", {}, dict(attn_mask=object()), "attn_mask"),
    ("dropout", {}, dict(dropout_p=0.1), "dropout"),
    ("cpu", dict(device=Device("cpu", None)), {}, "cpu tensor"),
    ("fp32", dict(dtype="float32"), {}, "dtype float32"),
    ("head dim", dict(D=96), {}, "head dim 96"),
    ("gqa without enable_gqa", dict(Hkv=2), {}, "enable_gqa is False"),
    ("gqa ratio", dict(Hq=6, Hkv=4), dict(enable_gqa=True), "not a multiple"),
    ("causal Nq != Nk", dict(Nq=100, Nk=300), dict(is_causal=True), "top-left"),
    ("empty", dict(Nk=0), {}, "empty"),
    ("scale", {}, dict(scale=-1.0), "scale"),
    ("scale nan", {}, dict(scale=float("nan")), "scale"),
    ("scale beyond float32", {}, dict(scale=1e39), "scale=1e+39"),  # the kernels take it as a float32
    ("scale subnormal", {}, dict(scale=1e-40), "scale=1e-40"),
    ("nvfp4 grad", {}, dict(family="nvfp4", grad_needed=True), "inference-only"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_unsupported_calls_name_the_reason(case):
    _, shape, kw, words = case
    got = reason(*qkv(**shape), **kw)
    assert got is not None and words in got, got


def test_top_left_causal_needs_square():
    """PyTorch's is_causal keeps key j for query i iff j <= i; the kernels' causal keeps j <= i + Nk - Nq. Equal only
    when Nq == Nk, so a rectangular causal call is PyTorch's; a rectangular non-causal one is the kernels'."""
    assert reason(*qkv(Nq=64, Nk=64), is_causal=True) is None
    for nq, nk in ((63, 64), (64, 63), (1, 64)):
        assert "top-left" in reason(*qkv(Nq=nq, Nk=nk), is_causal=True)
        assert reason(*qkv(Nq=nq, Nk=nk), is_causal=False) is None


def test_mixed_inputs():
    q, k, v = qkv()
    assert "different dtypes" in reason(q, Fake(k.shape, "float16"), v)
    assert "different devices" in reason(q, Fake(k.shape, device=Device("cuda", 1)), v)
    assert "value's shape" in reason(q, k, Fake((2, 8, 256, 64)))
    assert "batch sizes" in reason(q, Fake((1, 8, 256, 128)), Fake((1, 8, 256, 128)))
    assert "head dims" in reason(q, Fake((2, 8, 256, 64)), Fake((2, 8, 256, 64)))
    assert "4-D" in reason(Fake((8, 256, 128)), Fake((8, 256, 128)), Fake((8, 256, 128)))


def test_dtypes_are_the_callers():
    q, k, v = qkv(dtype="float32")
    assert reason(q, k, v, dtypes=("float32",)) is None


# --------------------------------------------------------------------------------------------------
# transformers' causal mask left out (hf_causal_needs_no_mask)
# --------------------------------------------------------------------------------------------------


def _transformers_causal(q_length, kv_length, q_offset, kv_offset):
    """masking_utils.causal_mask_function over these sizes: row i (position q_offset + i) sees key j (position
    kv_offset + j) when kv_offset + j <= q_offset + i."""
    return [[kv_offset + j <= q_offset + i for j in range(kv_length)] for i in range(q_length)]


def _maskless_attention(q_length, kv_length):
    """What the sagecupy transformers attention (and transformers' SDPA attention) computes given no mask: one row
    sees every key; several rows are causal, PyTorch's top-left alignment (keys past the rows dropped when there are
    more keys than rows, top-left causal through PyTorch when fewer)."""
    if q_length == 1:
        return [[True] * kv_length]
    return [[j <= i for j in range(kv_length)] for i in range(q_length)]


def test_hf_causal_needs_no_mask_only_where_it_is_the_mask():
    """Every size up to 5 and offset up to 3: leaving the mask out is claimed only where the maskless attention is
    transformers' causal mask."""
    for q_length in range(1, 6):
        for kv_length in range(1, 6):
            for q_offset in range(4):
                for kv_offset in range(4):
                    args = (q_length, kv_length, q_offset, kv_offset)
                    if dropin.hf_causal_needs_no_mask(*args):
                        assert _maskless_attention(q_length, kv_length) == _transformers_causal(*args), args


@pytest.mark.parametrize("args, expected", [
    ((256, 256, 0, 0), True),     # a forward without a cache, a prefill into an empty dynamic cache
    ((1, 41, 40, 0), True),       # a decoding row over a dynamic cache: sees every key
    ((64, 64, 3, 3), True),       # queries and keys shifted alike (a multi-token-prediction cache)
    ((1, 64, 40, 0), False),      # a decoding row over a static cache of 64: unwritten slots must be masked
    ((8, 48, 40, 0), False),      # several rows after a cached prefix: bottom-right causal, not the top-left rule
    ((8, 64, 0, 0), False),       # a prefill into a static cache: the keys past the rows are left to "sdpa"'s mask
    ((64, 64, 3, 0), False),      # queries ahead of the keys
    ((1, 41, None, 0), False),    # an offset kept in a tensor (a static cache) is not read
    ((256, 256, 0, None), False),
])
def test_hf_causal_needs_no_mask_cases(args, expected):
    assert dropin.hf_causal_needs_no_mask(*args) is expected


def test_options_are_checked():
    dropin.check_options("int8", "sdpa")
    with pytest.raises(ValueError, match="family='fp8'"):
        dropin.check_options("fp8", "sdpa")
    with pytest.raises(ValueError, match="fallback='silent'"):
        dropin.check_options("int8", "silent")


def test_fallback_log_counts_and_warns_once_per_reason():
    log = dropin.FallbackLog()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r in ("a", "b", "a", "a"):
            assert log.record(r) is True
    assert log.counts() == {"a": 3, "b": 1}
    assert [str(w.message).split(": ", 2)[-1].split(" (warned")[0] for w in caught] == ["a", "b"]
    assert all(issubclass(w.category, dropin.SageFallbackWarning) for w in caught)
    counts = log.counts()
    counts["a"] = 0  # a copy
    assert log.counts()["a"] == 3
    log.reset()
    assert log.counts() == {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.record("a")
    assert len(caught) == 1  # warns again after a reset


def test_importing_dropin_does_not_import_torch():
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, sagecupy.adapters.dropin; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
