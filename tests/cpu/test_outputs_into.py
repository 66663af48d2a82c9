"""Outputs written in place into a caller's buffers (``int8._forward_into`` / ``int8._backward_into``, what the JAX
adapter passes XLA's buffers to), on the INT8 host paths without a GPU (the stand-in cupy of test_host_paths): the
launches take the given arrays, the results are those arrays, and a buffer that is not what the launch program
would allocate is refused naming it."""
import numpy as np
import pytest

from test_host_paths import FakeArray, _inputs, gpu  # noqa: F401  (gpu: the fixture)


def _writes(launches, buf):
    return [x[0].split("<")[0] for x in launches if any(a is buf for a in x[3])]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_backward_writes_the_given_gradients(gpu, layout, engine):
    from sagecupy import int8

    q, k, v = _inputs(layout)
    do = FakeArray(q.shape, q.dtype)
    o, res = int8.forward(q, k, v, causal=True, layout=layout, engine=engine)
    for _ in range(2):  # recorded, then replayed
        out = (FakeArray(q.shape, q.dtype), FakeArray(k.shape, k.dtype), FakeArray(v.shape, v.dtype))
        start = len(gpu)
        grads = int8._backward_into(out, res, do, engine=engine)
        assert all(g is b for g, b in zip(grads, out))
        sfx = "_sm90" if engine == "wgmma" else ""
        assert _writes(gpu[start:], out[0]) == [f"int8_attn_bwd_dq{sfx}"]
        assert _writes(gpu[start:], out[1]) == _writes(gpu[start:], out[2]) == [f"int8_attn_bwd{sfx}"]


@pytest.mark.parametrize("inference", [True, False])
def test_forward_writes_the_given_output(gpu, inference):
    from sagecupy import int8

    q, k, v = _inputs()
    for _ in range(2):
        buf = FakeArray(q.shape, q.dtype)
        start = len(gpu)
        o, lse, res = int8._forward_into(buf, q, k, v, inference=inference, causal=False, sm_scale=None,
                                         layout="HND", config=None)
        assert o is buf and (res is None) == inference
        assert _writes(gpu[start:], buf) == ["int8_attn_fwd_sm90"]
        if not inference:
            assert res.o is buf  # the backward's delta reads this O


@pytest.mark.parametrize("bad,got", [
    (lambda s, d: FakeArray(s[:-1] + (s[-1] + 1,), d), "float16 (2, 2, 70, 129)"),
    (lambda s, d: FakeArray(s, np.float32), "got float32"),
    (lambda s, d: FakeArray(s, d, strides=FakeArray(s, d).strides[::-1]), "C-contiguous: False"),
    (lambda s, d: np.zeros(s, d), "got ndarray"),
], ids=["shape", "dtype", "strides", "numpy"])
def test_a_buffer_unlike_the_allocation_is_refused_naming_it(gpu, bad, got):
    from sagecupy import int8

    q, k, v = _inputs()
    o, res = int8.forward(q, k, v)
    out = (FakeArray(q.shape, q.dtype), bad(k.shape, k.dtype), FakeArray(v.shape, v.dtype))
    with pytest.raises((ValueError, TypeError), match="output buffer 'dk' must be") as err:
        int8._backward_into(out, res, FakeArray(q.shape, q.dtype))
    assert got in str(err.value)
    with pytest.raises((ValueError, TypeError), match="output buffer 'o' must be"):
        int8._forward_into(bad(q.shape, q.dtype), q, k, v, inference=True, causal=False, sm_scale=None,
                           layout="HND", config=None)
