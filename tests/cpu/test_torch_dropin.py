"""sagecupy.torch's drop-in SDPA and transformers attention on the CPU (skipped without PyTorch / transformers).

On CPU tensors every call falls back to PyTorch: the result must be PyTorch's, bit for bit, counted and warned once
per reason, under torch.compile(fullgraph=True) too. The kernel route is checked with the device check pointed at
"cuda" and a stand-in for the kernels (PyTorch's SDPA with the kernels' bottom-right causal mask), so
the wiring around the kernels (layouts, GQA, causality, scale, transformers' masks and decoding) runs here; the
kernels themselves are tests/gpu's.
"""
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sagecupy.torch")  # ImportError on PyTorch < 2.4 (no torch.library.custom_op)
F = torch.nn.functional

from sagecupy.adapters import dropin  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_counts():
    st.reset_fallback_counts()
    yield
    st.reset_fallback_counts()


def _qkv(B=2, Hq=4, Hkv=4, Nq=16, Nk=16, D=64, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype)
    return [x.requires_grad_(grad) for x in (q, k, v)]


CPU_CALLS = [
    ("plain", {}, {}),
    ("causal", {}, dict(is_causal=True)),
    ("gqa", dict(Hkv=2), dict(enable_gqa=True, is_causal=True)),
    ("scale", dict(Nq=5, Nk=9), dict(scale=0.3)),
    ("mask", {}, dict(attn_mask=torch.ones(16, 16, dtype=torch.bool).tril())),
]


@pytest.mark.parametrize("case", CPU_CALLS, ids=[c[0] for c in CPU_CALLS])
def test_cpu_calls_are_pytorchs(case):
    _, shape, kw = case
    q, k, v = _qkv(**shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SageFallbackWarning)
        got = st.scaled_dot_product_attention(q, k, v, **kw)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, **kw))
    assert sum(st.fallback_counts().values()) == 1


def test_fallback_warns_once_per_reason_and_counts():
    q, k, v = _qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            st.scaled_dot_product_attention(q, k, v)
        st.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    fallbacks = [w for w in caught if issubclass(w.category, st.SageFallbackWarning)]
    assert len(fallbacks) == 2 and all(w.filename == __file__ for w in fallbacks)  # points at the caller
    counts = st.fallback_counts()
    assert counts == {"query is a cpu tensor (the kernels run on CUDA tensors)": 3,
                      "dropout_p != 0 (the kernels have no dropout)": 1}
    st.reset_fallback_counts()
    assert st.fallback_counts() == {}


def test_fallback_error_raises_with_the_reason():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cpu tensor"):
        st.scaled_dot_product_attention(q, k, v, fallback="error")
    with pytest.raises(ValueError, match="family='fp8'"):
        st.scaled_dot_product_attention(q, k, v, family="fp8")
    assert st.fallback_counts() == {}


def test_compiled_fallback_has_no_graph_break():
    """fullgraph=True fails on any graph break: the bookkeeping runs at trace time, once per compiled graph."""
    q, k, v = _qkv(Hkv=2, grad=True)

    def f(q, k, v):
        return st.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SageFallbackWarning)
        for _ in range(3):
            o = compiled(q, k, v)
            o.sum().backward()
    assert torch.allclose(o, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert st.fallback_counts() == {"query is a cpu tensor (the kernels run on CUDA tensors)": 1}


def test_environment_reason(monkeypatch):
    """A GPU call still falls back when the kernels cannot run in this process: no NVRTC, or a pre-sm_80 GPU."""
    import sagecupy._loader as loader

    monkeypatch.setattr(st, "_ENVIRONMENT", {})
    monkeypatch.setattr(loader, "nvrtc_status", lambda: (False, "NVRTC does not load (test)"))
    assert st._environment_reason(0) == "sagecupy's GPU kernels are unavailable here: NVRTC does not load (test)"
    monkeypatch.setattr(st, "_ENVIRONMENT", {})
    monkeypatch.setattr(loader, "nvrtc_status", lambda: (True, "13.0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    assert st._environment_reason(1) == "compute capability 7.5 (the kernels need 8.0 or newer)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert st._environment_reason(1) == "compute capability 7.5 (the kernels need 8.0 or newer)"  # cached
    assert st._environment_reason(0) == ""


# --------------------------------------------------------------------------------------------------
# the kernel route, with the device check pointed at "cuda" and a stand-in for the kernels
# --------------------------------------------------------------------------------------------------


class _Cuda:
    type = "cuda"
    index = 0


_CUDA = _Cuda()


class _AsCuda:
    """A CPU tensor's metadata as if it lived on the GPU."""

    def __init__(self, t):
        self.shape, self.dtype, self.device = t.shape, t.dtype, _CUDA


def _reference(q, k, v, *, causal, sm_scale, layout, calls):
    """The kernels' contract in PyTorch: GQA by head index, causal bottom-right aligned, O in the input layout."""
    calls.append((tuple(q.shape), causal, layout, sm_scale))
    if layout == "NHD":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    nq, nk = q.shape[2], k.shape[2]
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq) if causal else None
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)
    return o.transpose(1, 2).contiguous() if layout == "NHD" else o


@pytest.fixture
def kernels(monkeypatch):
    """Route eligible float32 CPU calls to :func:`_reference` as if they were on a GPU; returns its call log."""
    calls = []

    def reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, family):
        return dropin.unsupported_reason(_AsCuda(query), _AsCuda(key), _AsCuda(value), attn_mask, dropout_p,
                                         is_causal, scale, enable_gqa, family=family,
                                         grad_needed=st._needs_grad(query, key, value),
                                         dtypes=(torch.float32,))

    def fake(q, k, v, *, causal, sm_scale, layout):
        return _reference(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, calls=calls)

    monkeypatch.setattr(st, "_kernel_reason", reason)
    for family in dropin.FAMILIES:
        monkeypatch.setitem(st._FAMILY_FUNCTIONS, family, fake)
    return calls


def test_kernel_route(kernels):
    q, k, v = _qkv(Hkv=2)
    o = st.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.2)
    assert torch.allclose(o, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.2))
    assert kernels == [((2, 4, 16, 64), True, "HND", 0.2)] and st.fallback_counts() == {}
    q, k, v = _qkv(Nq=5, Nk=9)
    st.scaled_dot_product_attention(q, k, v)  # rectangular, not causal: the kernels' too
    assert len(kernels) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SageFallbackWarning)
        o = st.scaled_dot_product_attention(q, k, v, is_causal=True)  # rectangular causal: top-left, PyTorch's
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v, is_causal=True)) and len(kernels) == 2
    assert list(st.fallback_counts()) == [dropin.unsupported_reason(*map(_AsCuda, (q, k, v)), is_causal=True,
                                                                     dtypes=(torch.float32,))]


def test_nvfp4_with_gradient_falls_back(kernels):
    q, k, v = _qkv(grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SageFallbackWarning)
        st.scaled_dot_product_attention(q, k, v, family="nvfp4")
    assert kernels == [] and "inference-only" in next(iter(st.fallback_counts()))
    with torch.no_grad():
        st.scaled_dot_product_attention(q, k, v, family="nvfp4")
    assert len(kernels) == 1
    with pytest.raises(ValueError, match="inference-only"):
        st.scaled_dot_product_attention(q, k, v, family="nvfp4", fallback="error")


def test_kernel_route_compiles_fullgraph(kernels):
    q, k, v = _qkv(Hkv=2, grad=True)

    def f(q, k, v):
        return st.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    o = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    o.sum().backward()
    assert torch.allclose(o, f(q, k, v)) and st.fallback_counts() == {} and kernels


def test_fake_implementations_give_the_lse():
    """Every forward op returns (o, lse, ...) with lse float32 (B, Hq, Nq) in either layout: what torch.compile
    plans with (the real ops are checked against these by torch.library.opcheck in tests/gpu)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for layout, qs, ks in (("HND", (2, 4, 100, 64), (2, 2, 130, 64)), ("NHD", (2, 100, 4, 128), (2, 130, 2, 128))):
            q, k = torch.empty(qs, dtype=torch.bfloat16), torch.empty(ks, dtype=torch.bfloat16)
            for op in ("sage_attention_fwd", "sage_attention_infer", "qat_attention_fwd", "nvfp4_attention"):
                o, lse, *_ = getattr(torch.ops.sagecupy, op)(q, k, k, True, None, layout, "")
                assert o.shape == q.shape and o.dtype == q.dtype, op
                assert lse.shape == (2, 4, 100) and lse.dtype == torch.float32, op


def test_nvfp4_config_crosses_the_op_boundary():
    from sagecupy.config import NVFP4Config

    from sagecupy.adapters import torch_ops

    cfg = NVFP4Config(two_level_p=False, k_smoothing=False)
    assert torch_ops._decode_config(torch_ops._encode_config(cfg)) == cfg


# --------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------


def _llama(attn, seed=0, **overrides):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   **overrides)
    torch.manual_seed(seed)
    # from_config writes attn_implementation into the config it is given: one copy per model
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn)


@pytest.fixture
def hf(kernels):
    pytest.importorskip("transformers")
    st.register_hf("sagecupy-test")
    sdpa = _llama("sdpa")
    sage = _llama("sagecupy-test")
    sage.load_state_dict(sdpa.state_dict())
    return sdpa, sage, kernels


def test_hf_registration():
    transformers = pytest.importorskip("transformers")
    fn = st.register_hf("sagecupy-reg", family="qat", fallback="error")
    assert transformers.AttentionInterface()["sagecupy-reg"] is fn
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert ALL_MASK_ATTENTION_FUNCTIONS["sagecupy-reg"].__name__ == "sagecupy_mask"
    with pytest.raises(ValueError, match="family"):
        st.register_hf("x", family="fp8")


def _causal_masks(attn, embeds, attention_mask=None, cache=None, position_ids=None, compiled=False):
    """transformers' create_causal_mask for a Llama config with attn_implementation ``attn`` (optionally traced by
    torch.compile(fullgraph=True))."""
    from transformers.masking_utils import create_causal_mask

    cfg = _llama(attn).config

    def build(embeds, attention_mask, position_ids):
        return create_causal_mask(cfg, embeds, attention_mask, cache, position_ids=position_ids)

    if compiled:
        torch._dynamo.reset()
        build = torch.compile(build, fullgraph=True, backend="eager")
    return build(embeds, attention_mask, position_ids)


def _cache(past, attn="sdpa"):
    """A DynamicCache holding ``past`` positions in every layer."""
    from transformers import DynamicCache

    cfg = _llama(attn).config
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        kv = torch.zeros(2, 2, past, 64)
        cache.update(kv, kv, layer)
    return cache


def _padded(n, left=3):
    mask = torch.ones(2, n, dtype=torch.long)
    mask[0, :left] = 0
    return mask


def _mask_cases():
    embeds = lambda n: torch.zeros(2, n, 256)  # noqa: E731
    return {
        "prefill": dict(embeds=embeds(12)),
        "prefill, all-ones mask": dict(embeds=embeds(12), attention_mask=torch.ones(2, 12, dtype=torch.long)),
        "padded prefill": dict(embeds=embeds(12), attention_mask=_padded(12)),
        "decoding row": dict(embeds=embeds(1), cache=lambda: _cache(7), attention_mask=torch.ones(2, 8)),
        "rows after a prefix": dict(embeds=embeds(3), cache=lambda: _cache(7)),
        "packed sequences": dict(embeds=embeds(6), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)),
    }


@pytest.mark.parametrize("case", list(_mask_cases()))
def test_hf_mask_is_sdpas_when_eager(case):
    """Eagerly the sagecupy mask function returns what "sdpa"'s does: None for plain causal attention (an all-ones
    padding mask included) and for a decoding row over a dynamic cache, the same mask otherwise."""
    pytest.importorskip("transformers")
    st.register_hf("sagecupy-mask")
    kw = dict(_mask_cases()[case])
    make_cache = kw.pop("cache", None)
    sdpa = _causal_masks("sdpa", cache=make_cache and make_cache(), **kw)
    sage = _causal_masks("sagecupy-mask", cache=make_cache and make_cache(), **kw)
    if case in ("prefill", "prefill, all-ones mask", "decoding row"):
        assert sdpa is None and sage is None
    else:
        assert sage is not None and torch.equal(sage, sdpa)


def test_hf_mask_under_torch_compile():
    """While tracing, transformers' sdpa_mask cannot read the padding mask and always builds a mask; the sagecupy
    one decides from sizes alone: None for a prefill and a decoding row, so the kernels run compiled. A 2-D padding
    mask and packed sequences (position_ids) still get "sdpa"'s mask, and fall back."""
    pytest.importorskip("transformers")
    st.register_hf("sagecupy-mask")
    cases = _mask_cases()
    assert _causal_masks("sdpa", compiled=True, **cases["prefill"]) is not None  # what the sagecupy one fixes
    assert _causal_masks("sagecupy-mask", compiled=True, **cases["prefill"]) is None
    assert _causal_masks("sagecupy-mask", compiled=True, embeds=torch.zeros(2, 1, 256), cache=_cache(7)) is None
    for case in ("prefill, all-ones mask", "padded prefill", "rows after a prefix", "packed sequences"):
        kw = dict(cases[case])
        make_cache = kw.pop("cache", None)
        got = _causal_masks("sagecupy-mask", compiled=True, cache=make_cache and make_cache(), **kw)
        want = _causal_masks("sdpa", compiled=True, cache=make_cache and make_cache(), **kw)
        assert got is not None and torch.equal(got, want), case


def test_hf_causal_lm_runs_the_kernels(hf):
    sdpa, sage, calls = hf
    ids = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(sage(ids).logits, sdpa(ids).logits, atol=1e-5)
    # one call per layer, causal, NHD (no transpose copy), GQA not repeated, the module's scaling
    assert calls == [((2, 33, 4, 64), True, "NHD", 64 ** -0.5)] * 2 and st.fallback_counts() == {}
    ones = torch.ones_like(ids)  # an all-ones padding mask is no mask
    assert torch.allclose(sage(ids, attention_mask=ones).logits, sdpa(ids).logits, atol=1e-5)
    assert st.fallback_counts() == {}


def test_hf_generation_decodes_without_a_mask(hf):
    sdpa, sage, calls = hf
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(sage.generate(ids, **kw), sdpa.generate(ids, **kw))
    assert calls[0][:2] == ((2, 5, 4, 64), True)  # prefill: causal
    assert calls[-1][:2] == ((2, 1, 4, 64), False)  # one decoding row sees every cached key
    assert st.fallback_counts() == {}


def test_hf_padding_falls_back_to_transformers_sdpa(hf):
    sdpa, sage, calls = hf
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SageFallbackWarning)
        got = sage(ids, attention_mask=mask).logits
    assert torch.equal(got, sdpa(ids, attention_mask=mask).logits) and calls == []
    (reason, count), = st.fallback_counts().items()
    assert "attention mask" in reason and count == 2  # one per layer


def test_hf_training_step_compiles_fullgraph(hf):
    sdpa, sage, calls = hf
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(4))
    for m in (sdpa, sage):
        m.train()
    torch._dynamo.reset()
    compiled = torch.compile(sage, fullgraph=True, backend="aot_eager")
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    ref = sdpa(ids, labels=ids).loss
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5) and calls and st.fallback_counts() == {}
    for (name, p), q in zip(sage.named_parameters(), sdpa.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name


def test_hf_compiled_padding_mask_falls_back(hf):
    """Under torch.compile a 2-D attention_mask, even all ones, cannot be read while tracing: transformers' SDPA
    attention runs, counted; fallback="error" raises instead."""
    sdpa, sage, calls = hf
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    ones = torch.ones_like(ids)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SageFallbackWarning)
        got = torch.compile(sage, fullgraph=True, backend="aot_eager")(ids, attention_mask=ones).logits
    assert torch.allclose(got, sdpa(ids, attention_mask=ones).logits, atol=1e-5) and calls == []
    (reason, count), = st.fallback_counts().items()
    assert "attention mask" in reason and count == 2
    st.register_hf("sagecupy-test", fallback="error")
    mask = ones.clone()
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="attention mask"):
        sage(ids, attention_mask=mask)
