"""Frozen configuration objects: every numerics-relevant choice of every family.

The same objects drive the float64 reference (``sagecupy.reference``) and the GPU
kernels, so a test can run the reference with exactly the kernel's choices.

Tile sizes that change numbers are fields here, because the SageBwd forward
quantizes P per token *per KV tile* and the backward quantizes P, dS per
``(bwd_block_q x bwd_block_kv)`` tile: the reference mirrors those tiles.

SageBwd granularities (docs/algorithms.md §2-4); every product is an integer matmul whose
scales factor out of the contraction:

=================  ==========================================================
field              meaning
=================  ==========================================================
q_granularity      ``"token"``: one scale per query row; ``"block"``: one per
                   ``block_q`` rows (all of D).
k_granularity      ``"token"`` / ``"block"`` (``block_kv`` rows).
v_granularity      ``"channel"``: one scale per head-dim column over the whole
                   sequence; ``"block"``: one per ``block_kv`` rows x D.
p_unsigned         P (non-negative) on ``[0, 255]`` (``True``, u8 x s8 mma) or
                   ``[0, 127]`` (``False``, the paper).
p_bwd_granularity  P feeding ``dV = P^T dO`` (contraction over query rows):
                   ``"column"``: one scale per key column of the backward tile;
                   ``"block"``: one per backward tile.
do_granularity     dO feeding ``dV``: ``"channel"``: one scale per head-dim
                   column of each ``bwd_block_q`` row block; ``"block"``: one
                   per ``bwd_block_q`` rows x D.
ds_granularity     ``"rowcol"``: ``dS diag(s_K)`` quantized per query row for
                   dQ and ``diag(s_Q) dS`` per key column for dK (two
                   quantizations); ``"block"``: one scale per backward tile
                   (still of the folded tensors).
dv_int8            ``True``: ``dV = P^T dO`` as an integer matmul of P^ and
                   dO^ (the two granularities above); ``False``: in the
                   inputs' 16-bit type (P rounded to it, dO as given, fp32
                   accumulation), as ``dP = dO V^T`` always is.
ds_int8            ``True``: ``dQ = X^ K^``, ``dK = Y^^T Q^`` as integer
                   matmuls of the quantized ``X = dS diag(s_K)``, ``Y =
                   diag(s_Q) dS`` (``ds_granularity``); ``False``: X and Y
                   rounded to bf16 (fp32's range, 8 significant bits per
                   element) against the exact INT8 codes of Q and K (integers
                   of at most 127 in magnitude are exact in bf16), with fp32
                   accumulation; ``ds_granularity`` then has no effect. The
                   kernels implement ``ds_int8=False`` with ``dv_int8=False``.
pv_int8            ``True``: the forward's ``O = P V`` as an integer matmul of
                   P^ (per token per ``block_kv`` tile, ``p_unsigned``) and V^
                   (``v_granularity``); ``False``: V as given and P~ rounded
                   to the inputs' 16-bit type in the softmax's running frame,
                   fp32 accumulation (O's error at sigma = 1 about a third
                   lower; ``block_kv`` then changes no number but where the
                   frame may move). The kernels implement ``False`` on the
                   wgmma engine (sm_90), dense and packed, with
                   ``v_granularity="channel"``.
=================  ==========================================================
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = ["SageBwdConfig", "NVFP4Config", "QATConfig", "PAPER", "DEFAULT", "BKV64", "get_config"]

_CHOICES = {
    "q_granularity": ("token", "block"),
    "k_granularity": ("token", "block"),
    "v_granularity": ("channel", "block"),
    "p_bwd_granularity": ("column", "block"),
    "do_granularity": ("channel", "block"),
    "ds_granularity": ("rowcol", "block"),
}


@dataclass(frozen=True)
class SageBwdConfig:
    """INT8 trainable attention (SageBwd). See the module docstring for the fields."""

    name: str = "default"
    block_q: int = 128
    block_kv: int = 128
    bwd_block_q: int = 64
    bwd_block_kv: int = 64
    q_granularity: Literal["token", "block"] = "token"
    k_granularity: Literal["token", "block"] = "token"
    v_granularity: Literal["channel", "block"] = "channel"
    p_unsigned: bool = True
    p_bwd_granularity: Literal["column", "block"] = "column"
    do_granularity: Literal["channel", "block"] = "channel"
    ds_granularity: Literal["rowcol", "block"] = "rowcol"
    dv_int8: bool = False
    ds_int8: bool = False
    pv_int8: bool = True
    k_smoothing: bool = True
    q_smoothing: bool = False
    ds_rowsum_correction: bool = False
    quantize: bool = True  # False: every quantizer is the identity (tests: equals exact attention)

    def __post_init__(self):
        for field, allowed in _CHOICES.items():
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"SageBwdConfig.{field}={value!r} is not supported; supported: {allowed}")
        for field in ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 16 or value % 16:
                raise ValueError(f"SageBwdConfig.{field}={value!r} must be a positive multiple of 16")
        for field in ("p_unsigned", "dv_int8", "ds_int8", "pv_int8", "k_smoothing", "q_smoothing",
                      "ds_rowsum_correction", "quantize"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"SageBwdConfig.{field} must be a bool, got {getattr(self, field)!r}")

    @property
    def p_max(self) -> int:
        """Largest code of quantized P: 255 (unsigned) or 127 (paper)."""
        return 255 if self.p_unsigned else 127

    def replace(self, **changes) -> "SageBwdConfig":
        return dataclasses.replace(self, **changes)


#: The published SageBwd: per-block Q, K, V, P (backward), dO, dS; P forward per token on [0, 127]; 64-key
#: forward tiles (the K and V blocks); dV, dQ and dK from INT8 codes (six of the seven products in INT8).
PAPER = SageBwdConfig(
    name="paper",
    dv_int8=True,
    ds_int8=True,
    block_kv=64,
    q_granularity="block",
    k_granularity="block",
    v_granularity="block",
    p_unsigned=False,
    p_bwd_granularity="block",
    do_granularity="block",
    ds_granularity="block",
)

#: The project default: the finest granularities integer matmuls allow, with the forward's P quantized per token
#: over 128-key tiles (``block_kv=128``); in the backward dV = P^T dO in the inputs' 16-bit type like dP = dO V^T
#: (``dv_int8=False``), and dQ, dK from dS rounded to bf16 against the INT8 codes of K and Q (``ds_int8=False``).
#: Each is more accurate than its INT8 form (relative L2 against exact attention at sigma = 1: dV 0.0122 -> 0.0092,
#: dQ and dK 0.0176 -> 0.0116) and faster, since the per-tile quantizations and int32 -> fp32 folds go: on an H100
#: the backward 1.03-1.05x (D = 128) and 1.10-1.13x (D = 64) for the 16-bit dV, then 1.09-1.16x and 1.22-1.29x for
#: the bf16 dQ, dK (docs/experiments.md, E-I8B-DV16, E-I8B-DS16).
DEFAULT = SageBwdConfig()

#: The default's granularities with the forward's P quantized per token over 64-key tiles: the finer P (O's
#: relative error ~4% lower at sigma = 1, the same at sigma >= 3) at 1.11-1.19x the forward kernel's time on
#: the H200 at D = 128 (docs/experiments.md). The default before commit 08ef803, but for its 16-bit dV, dQ and dK.
BKV64 = SageBwdConfig(name="bkv64", block_kv=64)

#: The default with the forward's O = P V in the inputs' 16-bit type (``pv_int8=False``): V is not quantized and P~
#: is rounded to fp16/bf16 in the softmax's running frame; O's relative error against exact attention at sigma = 1
#: about a third lower (0.0146 -> 0.0093 on an H100, D = 128), the LSE and the backward unchanged. On an H100 the
#: forward is 0.94-1.04x the default's at D = 64 (docs/experiments.md, E-I8F-OCC64B) and 0.86-1.00x at D = 128, where
#: its P.V takes twice the tensor-core time (E-I8F-PV16). The wgmma engine (sm_90), dense and packed layouts.
PV16 = SageBwdConfig(name="pv16", pv_int8=False)


@dataclass(frozen=True)
class NVFP4Config:
    """NVFP4 attention (docs/algorithms.md §5): 1x16 E2M1 blocks with E4M3 scales.

    ``two_level_p``: scale each P row to a tile max of 448*6 before the block
    quantization. ``tensor_scale``: the optional fp32 per-tensor second level for
    Q, K, V. ``block_kv``: the KV tile over which the two-level row max is taken.
    """

    name: str = "nvfp4"
    block_q: int = 128
    block_kv: int = 64
    two_level_p: bool = True
    k_smoothing: bool = True
    q_smoothing: bool = False
    tensor_scale: bool = False
    quantize: bool = True

    def __post_init__(self):
        for field in ("block_q", "block_kv"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 16 or value % 16:
                raise ValueError(f"NVFP4Config.{field}={value!r} must be a positive multiple of 16")

    def replace(self, **changes) -> "NVFP4Config":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class QATConfig:
    """FP4 quantization-aware training (docs/algorithms.md §6): NVFP4 fake quantization of Q, K, V, P."""

    name: str = "qat"
    block_kv: int = 64
    two_level_p: bool = True
    quantize: bool = True

    def replace(self, **changes) -> "QATConfig":
        return dataclasses.replace(self, **changes)


_NAMED = {"default": DEFAULT, "paper": PAPER, "bkv64": BKV64, "pv16": PV16}


def get_config(name_or_config=None) -> SageBwdConfig:
    """``None`` -> DEFAULT; ``"paper"``/``"default"`` -> the preset; a SageBwdConfig passes through."""
    if name_or_config is None:
        return DEFAULT
    if isinstance(name_or_config, SageBwdConfig):
        return name_or_config
    if isinstance(name_or_config, str) and name_or_config in _NAMED:
        return _NAMED[name_or_config]
    if not isinstance(name_or_config, str):  # another family's config, or not a config: the wrong type
        raise TypeError(f"config={name_or_config!r} is not supported; supported: 'default', 'paper', 'bkv64', "
                        f"'pv16' or a SageBwdConfig")
    raise ValueError(f"config={name_or_config!r} is not supported; supported: 'default', 'paper', 'bkv64', 'pv16' "
                     f"or a SageBwdConfig")
