"""sagecupy: trainable low-bit (INT8 / NVFP4) attention kernels for CuPy.

The float64 reference lives in :mod:`sagecupy.reference`; the GPU families in
:mod:`sagecupy.int8` (SageBwd), and the configuration objects in
:mod:`sagecupy.config`.
"""
from .config import DEFAULT, PAPER, NVFP4Config, QATConfig, SageBwdConfig, get_config

__version__ = "0.1.0"

__all__ = ["DEFAULT", "PAPER", "NVFP4Config", "QATConfig", "SageBwdConfig", "get_config", "__version__"]
