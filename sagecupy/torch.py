"""The PyTorch adapter under its public name; the implementation is :mod:`sagecupy.adapters.torch`.

Importing ``sagecupy.torch`` gives that very module (not a copy), so its custom ops are registered once."""
import sys

from .adapters import torch as _impl

sys.modules[__name__] = _impl
