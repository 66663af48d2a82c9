"""The framework adapters: :mod:`sagecupy.torch` (PyTorch custom ops and autograd, the SDPA drop-in whose decision
logic is :mod:`.dropin`), :mod:`sagecupy.jax`
(``jax.custom_vjp`` on XLA's stream) and :mod:`.bf16` (bfloat16 on the device: CuPy arrays of
``ml_dtypes.bfloat16``, or BF16Array where CuPy has no bfloat16 dtype). Each imports
its framework only when it is imported itself."""


def qat_module(who: str):
    """:mod:`sagecupy.qat` with its forward/backward pair, or an ImportError that names ``who`` needs it and what is
    missing (an installation without the QAT kernels); one check for every adapter."""
    import importlib

    try:
        mod = importlib.import_module("sagecupy.qat")
    except ImportError as exc:
        raise ImportError(f"{who} needs sagecupy.qat (the FP4 QAT GPU kernels), which cannot be imported here: "
                          f"{exc}") from exc
    if not (callable(getattr(mod, "forward", None)) and callable(getattr(mod, "backward", None))):
        raise ImportError(f"{who} needs sagecupy.qat.forward and sagecupy.qat.backward, which this installation's "
                          f"sagecupy.qat does not have")
    return mod
