"""sagecupy.jax.nvfp4_attention at trace time, without a GPU: shapes of its outputs, the arguments it refuses (naming
them), and that differentiating it raises instead of giving a zero gradient."""
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
sj = pytest.importorskip("sagecupy.jax")

from sagecupy.config import NVFP4Config  # noqa: E402


def _q(shape=(1, 2, 16, 64), dtype=None):
    return jnp.zeros(shape, dtype or jnp.float16)


def test_outputs_at_trace_time():
    q = _q()
    outs = jax.make_jaxpr(lambda q: sj.nvfp4_attention(q, q, q, return_lse=True))(q).out_avals
    assert [tuple(a.shape) for a in outs] == [(1, 2, 16, 64), (1, 2, 16)]
    assert outs[0].dtype == jnp.float16 and outs[1].dtype == jnp.float32
    outs = jax.make_jaxpr(lambda q: sj.nvfp4_attention(q, q, q, layout="NHD", config=NVFP4Config()))(_q()).out_avals
    assert len(outs) == 1 and tuple(outs[0].shape) == (1, 2, 16, 64)


def test_refusals_name_the_argument():
    q = _q()
    with pytest.raises(ValueError, match="layout='THD'.*nvfp4_attention"):
        sj.nvfp4_attention(q, q, q, layout="THD")
    with pytest.raises(TypeError, match="return_lse"):
        sj.nvfp4_attention(q, q, q, return_lse=1)
    with pytest.raises(TypeError, match="config"):
        sj.nvfp4_attention(q, q, q, config=[1])
    with pytest.raises(TypeError, match="sm_scale"):
        sj.nvfp4_attention(q, q, q, sm_scale="x")


def test_differentiating_raises():
    q = _q()
    with pytest.raises(ValueError, match="inference-only"):
        jax.make_jaxpr(jax.grad(lambda q: sj.nvfp4_attention(q, q, q).astype(jnp.float32).sum()))(q)


def test_exported():
    assert "nvfp4_attention" in sj.__all__
