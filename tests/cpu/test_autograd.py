"""The autograd shim on the CPU (NumPy, float64): every op against finite differences, the tape's
chaining, and the attention ops against the float64 references."""
import numpy as np
import pytest

from fd import fd_grad
from sagecupy import autograd as ag
from sagecupy.reference import attention as A
from sagecupy.reference import sagebwd as S


def _rng(seed=0):
    return np.random.default_rng(seed)


def _check_op(fwd, bwd, inputs, which, **opts):
    """Gradient of <dout, fwd(inputs)> w.r.t. inputs[which] from bwd equals central finite differences."""
    out, res = fwd(*inputs, **opts)
    dout = _rng(99).standard_normal(np.shape(out))
    grads = bwd(res, dout)
    for i in which:
        def f(x, i=i):
            args = list(inputs)
            args[i] = x
            return float(np.sum(fwd(*args, **opts)[0] * dout))

        num = fd_grad(f, inputs[i])
        err = np.linalg.norm(grads[i] - num) / max(np.linalg.norm(num), 1e-300)
        assert err < 1e-6, f"input {i}: relative error {err:.2e}"


def test_linear_with_and_without_bias():
    r = _rng(1)
    x, w, b = r.standard_normal((2, 3, 4)), r.standard_normal((4, 5)), r.standard_normal(5)
    _check_op(ag.linear_forward, ag.linear_backward, (x, w, b), (0, 1, 2))
    _check_op(ag.linear_forward, ag.linear_backward, (x, w), (0, 1))


def test_rms_norm():
    r = _rng(2)
    _check_op(ag.rms_norm_forward, ag.rms_norm_backward, (r.standard_normal((3, 4, 8)), r.standard_normal(8)), (0, 1))


def test_losses():
    r = _rng(3)
    _check_op(ag.mse_forward, ag.mse_backward, (r.standard_normal((3, 5)), r.standard_normal((3, 5))), (0,))
    labels = r.integers(0, 6, size=(2, 4))
    _check_op(ag.cross_entropy_forward, ag.cross_entropy_backward, (r.standard_normal((2, 4, 6)), labels), (0,))


@pytest.mark.parametrize("Hq,Hkv,Nq,Nk,causal", [(2, 2, 5, 5, True), (4, 2, 3, 7, True), (2, 1, 6, 3, True),
                                                 (2, 2, 4, 6, False)])
def test_fpa_attention_matches_reference_and_fd(Hq, Hkv, Nq, Nk, causal):
    r = _rng(4)
    q, k, v = r.standard_normal((1, Hq, Nq, 8)), r.standard_normal((1, Hkv, Nk, 8)), r.standard_normal((1, Hkv, Nk, 8))
    o, res = ag.fpa_forward(q, k, v, causal=causal)
    o_ref, lse = A.attention_forward(q, k, v, causal=causal)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    do = r.standard_normal(o.shape)
    for got, want in zip(ag.fpa_backward(res, do), A.attention_backward(q, k, v, o_ref, lse, do, causal=causal)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    _check_op(lambda q, k, v: ag.fpa_forward(q, k, v, causal=causal), ag.fpa_backward, (q, k, v), (0, 1, 2))


def _block(params, x, impl, config=None):
    """A tiny attention block with QK-norm on the tape: x -> q, k, v -> rms_norm(q), rms_norm(k) ->
    attention -> out projection -> mean squared error against a target."""
    wq, wk, wv, wo, gq, gk, target = params
    B, N, C = x.value.shape
    H, D = 2, C // 2

    def heads(t):
        return ag.apply(lambda a: (a.reshape(B, N, H, D).transpose(0, 2, 1, 3), None),
                        lambda _, g: (g.transpose(0, 2, 1, 3).reshape(B, N, C),), t)

    def merge(t):
        return ag.apply(lambda a: (a.transpose(0, 2, 1, 3).reshape(B, N, C), None),
                        lambda _, g: (g.reshape(B, N, H, D).transpose(0, 2, 1, 3),), t)

    q = ag.rms_norm(heads(ag.linear(x, wq)), gq)
    k = ag.rms_norm(heads(ag.linear(x, wk)), gk)
    v = heads(ag.linear(x, wv))
    o = ag.attention(q, k, v, impl=impl, causal=True, config=config)
    return ag.mse_loss(ag.linear(merge(o), wo), target)


def _params(seed, C=8, N=5):
    r = _rng(seed)
    vals = [r.standard_normal((C, C)) * 0.5 for _ in range(4)] + [1 + 0.1 * r.standard_normal(C // 2) for _ in range(2)]
    x = r.standard_normal((1, N, C))
    target = r.standard_normal((1, N, C))
    return [ag.Variable(p, name=f"p{i}") for i, p in enumerate(vals)] + [target], ag.Variable(x, name="x")


def test_tape_gradients_of_a_block_match_finite_differences():
    params, x = _params(5)
    loss = _block(params, x, "fpa")
    loss.backward()
    for i, p in enumerate(params[:6]):
        def f(val, i=i):
            ps = list(params)
            ps[i] = ag.Variable(val)
            return float(_block(ps, ag.Variable(x.value), "fpa").value)

        num = fd_grad(f, p.value)
        err = np.linalg.norm(p.grad - num) / np.linalg.norm(num)
        assert err < 1e-6, f"parameter {i}: relative error {err:.2e}"
    num_x = fd_grad(lambda val: float(_block(params, ag.Variable(val), "fpa").value), x.value)
    assert np.linalg.norm(x.grad - num_x) / np.linalg.norm(num_x) < 1e-6


def test_value_used_twice_sums_gradients():
    r = _rng(6)
    a = ag.Variable(r.standard_normal((3, 3)))
    y = ag.mse_loss(ag.linear(a, a), np.zeros((3, 3)))  # a @ a
    y.backward()
    num = fd_grad(lambda v: float(np.mean((v @ v) ** 2)), a.value)
    assert np.linalg.norm(a.grad - num) / np.linalg.norm(num) < 1e-6


def test_sagebwd_op_on_numpy_is_the_simulator():
    r = _rng(7)
    q, k, v = (r.standard_normal((1, 2, 70, 64)) for _ in range(3))
    do = r.standard_normal((1, 2, 70, 64))
    qv, kv, vv = (ag.Variable(t) for t in (q, k, v))
    o = ag.attention(qv, kv, vv, impl="sagebwd", causal=True, config="paper")
    o.backward(do)
    o_ref, res = S.forward(q, k, v, causal=True, config="paper")
    np.testing.assert_array_equal(o.value, o_ref)
    for got, want in zip((qv.grad, kv.grad, vv.grad), S.backward(res, do)):
        np.testing.assert_array_equal(got, want)


def test_errors():
    with pytest.raises(ValueError, match="impl"):
        ag.attention(np.zeros((1, 1, 2, 4)), np.zeros((1, 1, 2, 4)), np.zeros((1, 1, 2, 4)), impl="flash")
    with pytest.raises(ValueError, match="scalar"):
        ag.Variable(np.zeros(3)).backward()


def test_reshaping_ops_and_cast():
    r = _rng(8)
    x = ag.Variable(r.standard_normal((2, 5, 8)))
    w = r.standard_normal((8, 4))
    y = ag.take(ag.merge_heads(ag.split_heads(x, 2)), -1, axis=1)  # identity on position -1
    loss = ag.mse_loss(ag.linear(ag.cast(y, "float32"), w.astype(np.float32)), np.zeros((2, 4), np.float32))
    loss.backward()
    num = fd_grad(lambda v: float(np.mean((v[:, -1] @ w) ** 2)), x.value, h=1e-3)
    assert x.grad.dtype == np.float64
    assert np.linalg.norm(x.grad - num) / np.linalg.norm(num) < 1e-4  # float32 inside the cast
    assert np.all(x.grad[:, :-1] == 0)
