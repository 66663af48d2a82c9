"""The PyTorch adapter under its public name; the implementation is :mod:`sagecupy.adapters.torch`.

Importing ``sagecupy.torch`` gives that very module (not a copy), so its custom ops are registered once."""
import sys

from .adapters import torch as _impl
from .adapters import torch_cp as _cp

# context parallelism over torch.distributed (sagecupy.adapters.torch_cp) under this name too
for _name in _cp.__all__:
    setattr(_impl, _name, getattr(_cp, _name))
_impl.__all__ = [*_impl.__all__, *(n for n in _cp.__all__ if n not in _impl.__all__)]

sys.modules[__name__] = _impl
