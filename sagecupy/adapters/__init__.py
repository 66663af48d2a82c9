"""The framework adapters: :mod:`sagecupy.torch` (PyTorch custom ops and autograd, the SDPA drop-in whose decision
logic is :mod:`.dropin`), :mod:`sagecupy.jax`
(``jax.custom_vjp`` on XLA's stream) and :mod:`.bf16` (bfloat16 on the device: CuPy arrays of
``ml_dtypes.bfloat16``, or BF16Array where CuPy has no bfloat16 dtype). Each imports
its framework only when it is imported itself."""
