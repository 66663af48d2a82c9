"""Float64 NumPy reference of every sagecupy family: docs/algorithms.md in code.

Modules: ``attention`` (exact attention), ``quant`` (INT8 quantizers), ``fp4``
(E2M1 / E4M3 / NVFP4 / MXFP4 codecs), ``sagebwd`` (INT8 SageBwd simulator),
``nvfp4`` (NVFP4 attention simulator), ``qat`` (FP4 QAT simulator), ``metrics``,
``context_parallel`` (exact attention and SageBwd split into blocks over ranks, §9).
"""
