"""sagecupy.jax's keyword arguments at trace time, without a GPU: each is checked before it keys a cached op, so a
wrong value is refused by name and leaves nothing behind that a later valid call would find."""
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
sj = pytest.importorskip("sagecupy.jax")

from sagecupy.config import DEFAULT, NVFP4Config, QATConfig  # noqa: E402

FAMILIES = ("sage_attention", "qat_attention", "nvfp4_attention")


def _q():
    return jnp.zeros((1, 2, 16, 64), jnp.float16)


def _trace(name, **kw):
    fn = getattr(sj, name)
    return jax.make_jaxpr(lambda q: fn(q, q, q, **kw))(_q())


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("bad", [0, 1, None, "True"])
def test_a_non_bool_causal_is_refused_and_later_calls_still_trace(name, bad):
    with pytest.raises(TypeError, match=f"causal must be a bool, got {bad!r}"):
        _trace(name, causal=bad)
    # 0 == False and 1 == True as cache keys: the op a bool builds must not be reached, nor poisoned, by the int
    _trace(name)
    _trace(name, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        _trace(name, causal=bad)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("bad", [True, "0.5", b"0.5"])
def test_sm_scale_that_float_would_coerce_is_refused(name, bad):
    with pytest.raises(TypeError, match="sm_scale must be a float or None"):
        _trace(name, sm_scale=bad)


@pytest.mark.parametrize("name", FAMILIES)
def test_sm_scale_out_of_the_kernels_range_is_refused_at_trace_time(name):
    with pytest.raises(ValueError, match=r"sm_scale=1e\+39 must be finite and > 0, within"):
        _trace(name, sm_scale=1e39)
    _trace(name, sm_scale=0.5)


@pytest.mark.parametrize("name,cfg,exc,words", [
    ("qat_attention", DEFAULT, TypeError, "config must be a QATConfig or None, got SageBwdConfig"),
    ("qat_attention", QATConfig(two_level_p=False), ValueError, "config: two_level_p=False is reference-only"),
    ("nvfp4_attention", QATConfig(), TypeError, "config must be an NVFP4Config or None, got QATConfig"),
    ("nvfp4_attention", NVFP4Config(two_level_p=1), ValueError, "config: two_level_p=1 must be a bool"),
    ("sage_attention", QATConfig(), TypeError, "config=QATConfig"),
])
def test_configs_are_checked_before_tracing(name, cfg, exc, words):
    with pytest.raises(exc, match=words):
        _trace(name, config=cfg)
