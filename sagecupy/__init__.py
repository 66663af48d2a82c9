"""sagecupy: trainable low-bit (INT8 / NVFP4) attention kernels for CuPy.

The float64 reference lives in :mod:`sagecupy.reference`; the GPU families in
:mod:`sagecupy.int8` (SageBwd), :mod:`sagecupy.nvfp4` and :mod:`sagecupy.qat`;
the configuration objects in :mod:`sagecupy.config`; the command line
(``sagecupy`` or ``python -m sagecupy``) in :mod:`sagecupy.cli`; :func:`warmup` compiles the kernels ahead of use.
"""
# The one version string: setup.cfg reads it (``version = attr: sagecupy.__version__``) without importing
# the package, so it stays a plain literal assignment.
__version__ = "0.1.0"

import os as _os  # noqa: E402

# In a source checkout used without installing (``python -m pytest`` from the repository root puts the
# checkout first on sys.path), the sub-packages that setup.cfg maps from top-level folders
# (``reference/`` -> ``sagecupy.reference``, ``kernels_cu/`` -> ``sagecupy.kernels_cu``) are not inside
# this folder: let the package find them beside it. Installed packages have them inside and skip this.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "reference")) and _os.path.isfile(
        _os.path.join(_root, "reference", "__init__.py")):
    __path__.append(_root)

from .config import DEFAULT, PAPER, NVFP4Config, QATConfig, SageBwdConfig, get_config  # noqa: E402
from ._warmup import warmup  # noqa: E402

__all__ = ["DEFAULT", "PAPER", "NVFP4Config", "QATConfig", "SageBwdConfig", "get_config", "warmup", "__version__"]
