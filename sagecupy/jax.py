"""The JAX adapter under its public name; the implementation is :mod:`sagecupy.adapters.jax`.

Importing ``sagecupy.jax`` gives that very module (not a copy), so its custom ops are registered once."""
import sys

from .adapters import jax as _impl

sys.modules[__name__] = _impl
