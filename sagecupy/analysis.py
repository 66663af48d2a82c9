"""The standard accuracy experiments of docs/algorithms.md §7, as importable functions.

The ``sagecupy`` command line (:mod:`sagecupy.cli`) is a thin layer over this
module; everything here returns plain data — a list of dicts, one per
measurement — plus an environment header (:func:`header`), so results can be
written as JSON lines or CSV, or used directly from Python::

    from sagecupy import analysis
    spec = analysis.RunSpec(family="int8", config="paper", shape=analysis.Shape(n=256))
    records = analysis.accuracy_sweep(spec)            # docs/algorithms.md §7 σ-sweep
    records = analysis.intermediates(spec, sigma=5.0)  # δ, P, dP, dS, O, dQ, dK, dV + dS bound
    records = analysis.smoothing_ablation(spec)        # none / K / Q+K smoothing

Ground truth
    Always the exact float64 attention (:mod:`sagecupy.reference.attention`)
    computed on the *same* inputs the measured computation sees: inputs are
    drawn in float64 and rounded to the input dtype (fp16 or bf16) first, so
    the input rounding is not counted as an error of the low-bit algorithm.

Backends
    ``"reference"``: the float64 quantization-aware simulators of
    :mod:`sagecupy.reference` (SageBwd, NVFP4, FP4 QAT); no GPU needed.
    ``"gpu"``: the CuPy kernels; inputs go to the device in the input dtype and
    the results come back as float64. Only the families in
    :data:`GPU_FAMILIES` have kernels wired here. ``"auto"``: the GPU when
    :func:`sagecupy._loader.gpu_status` reports a usable device and the family
    has kernels, otherwise the reference (:func:`resolve_backend` returns the
    reason, which the CLI prints on one stderr line).

Inputs (σ-sweep)
    ``Q, K ~ N(0, σ²)``, ``V, dO ~ N(0, 1)``. One standard-normal draw per
    seed is shared by every σ (``Q = σ·Z_Q``), so the rows of a sweep differ
    only in σ. Every shape here is HND: ``(B, H, N, D)``, self-attention
    ``Nq = Nk = N``. Files given to :func:`load_inputs` may use GQA and
    ``Nq != Nk``.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from ._checks import SUPPORTED_HEAD_DIMS
from .config import NVFP4Config, QATConfig, SageBwdConfig, get_config

__all__ = [
    "FAMILIES",
    "BACKENDS",
    "DTYPES",
    "CONFIG_NAMES",
    "SIGMAS",
    "GPU_DEFAULT_N",
    "CPU_DEFAULT_N",
    "GPU_FAMILIES",
    "GPU_HEAD_DIMS",
    "ACCURACY_TENSORS",
    "INTERMEDIATE_TENSORS",
    "SMOOTHING_VARIANTS",
    "Family",
    "Shape",
    "RunSpec",
    "BackendUnavailable",
    "family",
    "resolve_config",
    "resolve_backend",
    "default_n",
    "family_status",
    "gpu_status",
    "round_to_dtype",
    "bf16_bits",
    "make_inputs",
    "load_inputs",
    "run_family",
    "accuracy_sweep",
    "worst_case",
    "intermediates",
    "smoothing_ablation",
    "check_smoothing",
    "check_reference_memory",
    "reference_peak_bytes",
    "header",
]

BACKENDS = ("auto", "reference", "gpu")
DTYPES = ("fp16", "bf16")
#: Named configs per family (``--config``): SageBwd's presets, and the NVFP4 / QAT variants the accuracy
#: tables compare (two-level P and K-smoothing on or off).
FAMILY_CONFIGS = {
    "int8": ("default", "paper", "bkv64", "pv16"),
    "nvfp4": ("default", "single-level-p", "no-smoothing", "plain"),
    "qat": ("default",),
}
CONFIG_NAMES = ("default", "paper", "bkv64", "pv16", "single-level-p", "no-smoothing", "plain")
#: What each named config is, for ``--config``'s help (keys of :data:`FAMILY_CONFIGS`).
CONFIG_HELP = {
    ("int8", "default"): "the finest granularities",
    ("int8", "paper"): "the published SageBwd granularities",
    ("int8", "bkv64"): "default with 64-key forward tiles",
    ("int8", "pv16"): "default with the forward's P.V in 16 bits",
    ("nvfp4", "default"): "two-level P, K-smoothing",
    ("nvfp4", "single-level-p"): "two-level P off",
    ("nvfp4", "no-smoothing"): "K-smoothing off",
    ("nvfp4", "plain"): "both off",
    ("qat", "default"): "NVFP4 fake quantization",
}
#: docs/algorithms.md §7: the σ of Q and K in the sweep.
SIGMAS = (1.0, 3.0, 5.0, 8.0, 10.0)
#: docs/algorithms.md §7 default sequence length on a GPU.
GPU_DEFAULT_N = 4096
#: Default sequence length for the float64 reference, small enough that the
#: default ``sagecupy accuracy`` (int8, default config) takes under 80 s and
#: about 0.8 GB on a 2-core machine (the simulator holds one head's (N, N)
#: matrices at a time; the exact side runs by blocks).
CPU_DEFAULT_N = 2048
DEFAULT_BATCH, DEFAULT_HEADS, DEFAULT_D = 1, 8, 128
#: The head dims the GPU kernels are built for; the reference simulators take any D.
GPU_HEAD_DIMS = SUPPORTED_HEAD_DIMS

ACCURACY_TENSORS = ("O", "dQ", "dK", "dV")
#: docs/algorithms.md §7 intermediates, in the order they are reported.
INTERMEDIATE_TENSORS = ("delta", "P", "dP", "dS", "O", "dQ", "dK", "dV")
#: The smoothing ablation: (name, k_smoothing, q_smoothing).
SMOOTHING_VARIANTS = (("none", False, False), ("K", True, False), ("Q+K", True, True))

#: Where a measured tensor came from (the ``source`` field of intermediates).
SOURCE_REFERENCE = "reference-sim"
SOURCE_GPU = "gpu"


class BackendUnavailable(ValueError):
    """The requested backend cannot run here (no device, no kernels for the family)."""


# ----------------------------------------------------------------------------
# families
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One algorithm family: what it computes and where its code lives."""

    name: str
    title: str
    has_backward: bool
    reference_module: str
    gpu_module: str
    config_type: type


_FAMILIES = {
    "int8": Family("int8", "SageBwd INT8 forward + backward", True,
                   "sagecupy.reference.sagebwd", "sagecupy.int8", SageBwdConfig),
    "nvfp4": Family("nvfp4", "NVFP4 attention forward (SageAttention3-style)", False,
                    "sagecupy.reference.nvfp4", "sagecupy.nvfp4", NVFP4Config),
    "qat": Family("qat", "FP4 QAT forward + backward (Attn-QAT-style)", True,
                  "sagecupy.reference.qat", "sagecupy.qat", QATConfig),
}
FAMILIES = tuple(_FAMILIES)

#: Families whose GPU kernels this module knows how to call. Extend when a
#: family's ``forward(q, k, v, *, causal, sm_scale, layout, config) -> (o, residuals)``
#: (and ``backward(residuals, do)``) lands.
GPU_FAMILIES = ("int8", "nvfp4", "qat")


def family(name: str) -> Family:
    """The :class:`Family` called ``name`` (ValueError naming the choices otherwise)."""
    if name not in _FAMILIES:
        raise ValueError(f"family={name!r} is not supported; supported: {', '.join(FAMILIES)}")
    return _FAMILIES[name]


def resolve_config(family_name: str, config=None):
    """The config object for ``family_name``.

    ``int8``: ``"default"`` / ``"paper"`` / a :class:`SageBwdConfig` (see
    :func:`sagecupy.config.get_config`). ``nvfp4`` and ``qat`` have one preset
    each (their config class's defaults), selected by ``None`` or
    ``"default"``; a config object of the right class passes through.
    """
    fam = family(family_name)
    if isinstance(config, fam.config_type):
        return config
    if fam.name == "int8":
        return get_config(config)
    if config is None or config == "default":
        return fam.config_type()
    if fam.name == "nvfp4" and config in FAMILY_CONFIGS["nvfp4"]:
        changes = {"single-level-p": dict(two_level_p=False), "no-smoothing": dict(k_smoothing=False),
                   "plain": dict(two_level_p=False, k_smoothing=False)}[config]
        return NVFP4Config(name=config, **changes)
    raise ValueError(
        f"config={config!r} is not supported for family {fam.name!r}; supported: "
        f"{', '.join(repr(c) for c in FAMILY_CONFIGS[fam.name])}"
    )


def _config_fields(config) -> dict:
    return dataclasses.asdict(config)


# ----------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------


def gpu_status() -> tuple[bool, str]:
    """``sagecupy._loader.gpu_status()``, or (False, why) when the loader is not there."""
    try:
        loader = importlib.import_module("sagecupy._loader")
    except ImportError as exc:
        return False, f"the GPU kernel loader is not available ({exc})"
    try:
        ok, reason = loader.gpu_status()
    except Exception as exc:  # a broken driver must read as "no GPU", not crash the CLI
        return False, f"gpu_status() failed: {type(exc).__name__}: {exc}"
    return bool(ok), str(reason)


def _gpu_module(fam: Family):
    """Import the family's GPU module; (module, None) or (None, why not)."""
    if fam.name not in GPU_FAMILIES:
        return None, f"GPU kernels for family {fam.name!r} are planned, not built"
    try:
        return importlib.import_module(fam.gpu_module), None
    except ImportError as exc:
        return None, f"{fam.gpu_module} is not available ({exc})"


def family_status(family_name: str) -> dict:
    """Feature detection for ``sagecupy info``: can each backend run this family here?

    Returns ``dict(family, title, backward, reference, reference_reason, gpu,
    gpu_reason, gpu_short)``; ``gpu_short`` is ``"no GPU"``, ``"planned"``,
    ``"module missing"`` or ``"ok"``.
    """
    fam = family(family_name)
    try:
        importlib.import_module(fam.reference_module)
        ref_ok, ref_reason = True, "float64 simulator"
    except ImportError as exc:
        ref_ok, ref_reason = False, f"{fam.reference_module} is not available ({exc})"
    gpu_ok, gpu_reason = gpu_status()
    short = "ok" if gpu_ok else "no GPU"
    if gpu_ok or fam.name not in GPU_FAMILIES:
        module, why = _gpu_module(fam)
        if module is None:
            gpu_ok, gpu_reason = False, why
            short = "planned" if fam.name not in GPU_FAMILIES else "module missing"
    return {"family": fam.name, "title": fam.title, "backward": fam.has_backward,
            "reference": ref_ok, "reference_reason": ref_reason, "gpu": gpu_ok, "gpu_reason": gpu_reason,
            "gpu_short": short}


def resolve_backend(backend: str, family_name: str, head_dim: int | None = None) -> tuple[str, str]:
    """``(resolved backend, reason)`` for ``backend`` in :data:`BACKENDS`.

    ``"gpu"`` raises :class:`BackendUnavailable` when there is no usable device,
    the family has no kernels or ``head_dim`` (when given) is not one of
    :data:`GPU_HEAD_DIMS`; ``"auto"`` then falls back to the reference and says why.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; supported: {', '.join(BACKENDS)}")
    fam = family(family_name)
    if backend == "reference":
        return "reference", "requested"
    ok, reason = gpu_status()
    if ok:
        module, why = _gpu_module(fam)
        if module is None:
            ok, reason = False, why
    if ok and head_dim is not None and head_dim not in GPU_HEAD_DIMS:
        dims = " and ".join(str(d) for d in GPU_HEAD_DIMS)
        ok, reason = False, f"the GPU kernels take head dims {dims}, not D={head_dim}"
    if ok:
        return "gpu", f"GPU available: {reason}"
    if backend == "gpu":
        raise BackendUnavailable(f"--backend gpu cannot run family {fam.name}: {reason}; use --backend reference")
    return "reference", reason


def default_n(backend: str) -> int:
    """docs/algorithms.md §7 default N: :data:`GPU_DEFAULT_N` on the GPU, :data:`CPU_DEFAULT_N` on the reference."""
    return GPU_DEFAULT_N if backend == "gpu" else CPU_DEFAULT_N


# ----------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A self-attention problem ``(batch, heads, n, d)`` in HND layout."""

    batch: int = DEFAULT_BATCH
    heads: int = DEFAULT_HEADS
    n: int = CPU_DEFAULT_N
    d: int = DEFAULT_D

    def __post_init__(self):
        for name in ("batch", "heads", "n", "d"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @property
    def hnd(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.n, self.d)


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; supported: {', '.join(DTYPES)}")
    return dtype


def bf16_bits(x) -> np.ndarray:
    """uint16 bit patterns of ``x`` rounded to bfloat16 (round to nearest, ties to even).

    Rounds once, from the float64 value (going through float32 first would
    round twice). Overflow gives ±inf, NaN stays NaN, subnormals are kept.
    """
    x = np.asarray(x, dtype=np.float64)
    r = round_to_dtype(x, "bf16")
    return (r.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    # bfloat16 = float32's 8 exponent bits + 7 fraction bits. In float64 bits that
    # is the top 16 bits plus 36 more fraction bits to drop: 52 - 7 = 45 bits.
    # Adding (2^44 - 1) + lsb and truncating is round-half-even on the magnitude;
    # it is exact for every value in bfloat16's normal range.
    bits = x.view(np.uint64)
    drop = np.uint64(45)
    lsb = (bits >> drop) & np.uint64(1)
    rounded = ((bits + (np.uint64((1 << 44) - 1) + lsb)) >> drop) << drop
    out = rounded.view(np.float64).copy()
    ax = np.abs(x)
    # bfloat16 subnormals (|x| < 2^-126): a fixed spacing of 2^-133.
    tiny = ax < 2.0 ** -126
    if tiny.any():
        out[tiny] = np.rint(x[tiny] * 2.0 ** 133) * 2.0 ** -133
    # overflow: the largest bfloat16 is (2 - 2^-7) 2^127; at or past the halfway
    # point to 2^128 RNE goes to infinity.
    with np.errstate(invalid="ignore"):
        big = ax >= (2.0 - 2.0 ** -8) * 2.0 ** 127
    out[big] = np.copysign(np.inf, x[big])
    nan = np.isnan(x)
    out[nan] = np.nan
    return out


def round_to_dtype(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (``"fp16"`` or ``"bf16"``) and returned as float64.

    fp16 through NumPy's float64 -> float16 conversion (round to nearest even);
    bf16 by bit manipulation on the float64 representation (see :func:`bf16_bits`).
    """
    _check_dtype(dtype)
    x = np.asarray(x, dtype=np.float64)
    if dtype == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float64)
    return _round_bf16(np.ascontiguousarray(x))


def make_inputs(shape: Shape, sigma: float, seed: int, dtype: str = "fp16") -> dict:
    """docs/algorithms.md §7.1 inputs: ``q, k ~ N(0, σ²)``, ``v, do ~ N(0, 1)``, rounded to ``dtype``.

    Returns ``dict(q, k, v, do)`` of HND float64 arrays holding dtype-representable
    values. The standard-normal draws depend on ``seed`` only, not on ``sigma``.
    """
    sigma = _check_sigma(sigma)
    _check_dtype(dtype)
    rng = np.random.default_rng(seed)
    z = {name: rng.standard_normal(shape.hnd) for name in ("q", "k", "v", "do")}
    scale = {"q": sigma, "k": sigma, "v": 1.0, "do": 1.0}
    return {name: round_to_dtype(scale[name] * z[name], dtype) for name in z}


def _check_sigma(sigma) -> float:
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"sigma={sigma!r} must be a positive finite number")
    return float(sigma)


#: The arrays an ``--load`` file must hold.
LOAD_KEYS = ("q", "k", "v", "do")


def load_inputs(path, dtype: str = "fp16", layout: str = "HND") -> dict:
    """Read ``q, k, v, do`` from an ``.npz`` file (``np.savez(path, q=..., k=..., v=..., do=...)``).

    Shapes in ``layout`` (``"HND"``: ``q`` and ``do`` ``(B, Hq, Nq, D)``, ``k``
    and ``v`` ``(B, Hkv, Nk, D)``; ``"NHD"``: ``(B, N, H, D)``); GQA allowed.
    Other keys in the file are ignored. The values are rounded to ``dtype``
    (what a kernel would be given) and returned as HND float64 arrays.
    Raises ValueError with the reason for a missing or unreadable file, a
    ``.npy`` file, missing keys, bad shapes and non-finite values.
    """
    from sagecupy.reference.attention import check_qkv, to_hnd

    _check_dtype(dtype)
    path = str(path)
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable .npz file ({exc})") from None
    if isinstance(data, np.ndarray):
        raise ValueError(
            f"{path} holds a single array (.npy); an .npz with the keys {', '.join(LOAD_KEYS)} is needed: "
            f"np.savez(path, q=q, k=k, v=v, do=do)"
        )
    with data:
        found = list(data.files)
        missing = [key for key in LOAD_KEYS if key not in found]
        if missing:
            raise ValueError(
                f"{path} lacks the key(s) {', '.join(missing)}; it must hold {', '.join(LOAD_KEYS)} "
                f"(found: {', '.join(found) or 'none'})"
            )
        arrays = {key: data[key] for key in LOAD_KEYS}
    for key, arr in arrays.items():
        if arr.dtype.kind not in "fiu":
            raise ValueError(f"{path}: {key} must hold real numbers, got dtype {arr.dtype}")
        if arr.ndim != 4:
            raise ValueError(f"{path}: {key} must be 4-D ({layout}), got shape {arr.shape}")
    check_qkv(arrays["q"], arrays["k"], arrays["v"], layout)
    if arrays["do"].shape != arrays["q"].shape:
        raise ValueError(f"{path}: do must have q's shape {arrays['q'].shape}, got {arrays['do'].shape}")
    out = {}
    for key, arr in arrays.items():
        x = np.ascontiguousarray(to_hnd(arr.astype(np.float64), layout))
        if not np.isfinite(x).all():
            raise ValueError(f"{path}: {key} has NaN or Inf values")
        x = round_to_dtype(x, dtype)
        if not np.isfinite(x).all():
            raise ValueError(f"{path}: {key} has values outside the {dtype} range")
        out[key] = x
    return out


# ----------------------------------------------------------------------------
# running a family
# ----------------------------------------------------------------------------


def _run_reference(fam: Family, config, inputs: dict, causal: bool, want_intermediates: bool,
                   dtype: str = "fp16") -> dict:
    """The family's float64 simulator on HND inputs (values of ``dtype``) -> dict of HND float64 tensors."""
    module = importlib.import_module(fam.reference_module)
    q, k, v, do = (inputs[name] for name in LOAD_KEYS)
    kw = dict(causal=causal, sm_scale=None, layout="HND", config=config)
    if fam.name == "int8":
        kw["dtype"] = {"fp16": "float16", "bf16": "bfloat16"}[_check_dtype(dtype)]  # (P's rounding, dv_int8=False)
        if not want_intermediates:  # (forward and backward alone hold one head's (N, N) matrices at a time)
            o, residuals = module.forward(q, k, v, **kw)
            grads = module.backward(residuals, do)
            return {key: np.asarray(x, dtype=np.float64) for key, x in zip(ACCURACY_TENSORS, (o, *grads))}
        out = module.run(q, k, v, do, **kw)
        return {key: np.asarray(out[key], dtype=np.float64) for key in INTERMEDIATE_TENSORS if key in out}
    if fam.name == "nvfp4":
        if not want_intermediates:
            o, _ = module.forward(q, k, v, **kw)
            return {"O": np.asarray(o, dtype=np.float64)}
        o, _, inter = module.forward(q, k, v, return_intermediates=True, **kw)
        # The probabilities that actually multiply V̂, normalized: O = (P_hat / l) V̂.
        l = inter["l"][..., None]
        p = np.where(l > 0, inter["P_hat"] / np.where(l > 0, l, 1.0), 0.0)
        return {"P": p, "O": np.asarray(o, dtype=np.float64)}
    if fam.name == "qat":
        if want_intermediates:
            o, residuals, inter = module.forward(q, k, v, return_intermediates=True, **kw)
        else:
            o, residuals = module.forward(q, k, v, **kw)
        dq, dk, dv = module.backward(residuals, do)
        out = {name: np.asarray(x, dtype=np.float64) for name, x in zip(ACCURACY_TENSORS, (o, dq, dk, dv))}
        if want_intermediates:
            out["P"] = inter["P"]  # softmax of the fake-quantized logits: the P of dS = P ∘ (dP − δ)
        return out
    raise AssertionError(fam.name)  # unreachable: family() validated the name


def _to_device(x: np.ndarray, dtype: str):
    """A device array of ``dtype`` holding the (already rounded) float64 values ``x``.

    fp16: a CuPy float16 array. bf16: the raw bits (:func:`bf16_bits`) as a CuPy
    ``ml_dtypes.bfloat16`` array where CuPy has that dtype, else wrapped in
    :class:`sagecupy.adapters.bf16.BF16Array` (:func:`sagecupy.adapters.bf16.from_bits`).
    """
    import cupy as cp

    from sagecupy.adapters.bf16 import from_bits

    if dtype == "fp16":
        return cp.asarray(x.astype(np.float16))
    return from_bits(cp.asarray(bf16_bits(x)))


def _to_host(x) -> np.ndarray:
    """A device (or host) array of any float dtype, bfloat16 included, as float64 on the host."""

    def host(a):
        return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)

    if "bfloat16" in str(getattr(x, "dtype", "")):
        # Through the raw bits (bfloat16 is the top half of a float32): a BF16Array
        # keeps them in ``.bits``; a CuPy / NumPy bfloat16 array is viewed as uint16.
        bits = host(x.bits if hasattr(x, "bits") else x.view(np.uint16))
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return host(x).astype(np.float64)


def _run_gpu(fam: Family, config, inputs: dict, causal: bool, dtype: str) -> dict:
    """The family's GPU kernels on the device copies of ``inputs`` -> HND float64 tensors."""
    module, why = _gpu_module(fam)
    if module is None:
        raise BackendUnavailable(why)
    q, k, v, do = (_to_device(inputs[name], dtype) for name in LOAD_KEYS)
    o, residuals = module.forward(q, k, v, causal=causal, sm_scale=None, layout="HND", config=config)
    out = {"O": _to_host(o)}
    if fam.has_backward:
        dq, dk, dv = module.backward(residuals, do)
        out.update(dQ=_to_host(dq), dK=_to_host(dk), dV=_to_host(dv))
    return out


def run_family(backend: str, family_name: str, config, inputs: dict, *, causal: bool = False,
               dtype: str = "fp16", want_intermediates: bool = False) -> tuple[dict, dict]:
    """Run one family on one set of inputs; returns ``(tensors, sources)``.

    ``tensors``: HND float64 arrays keyed like :data:`INTERMEDIATE_TENSORS`;
    ``sources``: for each key, :data:`SOURCE_GPU` or :data:`SOURCE_REFERENCE`.
    On the GPU backend with ``want_intermediates``, the tensors the kernels do
    not return (δ, P, dP, dS) come from the reference simulator with the same
    config on the same inputs, and their source says so.
    """
    fam = family(family_name)
    config = resolve_config(family_name, config)
    if backend == "reference":
        tensors = _run_reference(fam, config, inputs, causal, want_intermediates, dtype)
        return tensors, {key: SOURCE_REFERENCE for key in tensors}
    if backend != "gpu":
        raise ValueError(f"backend={backend!r} must be resolved to 'reference' or 'gpu' first")
    tensors = _run_gpu(fam, config, inputs, causal, dtype)
    sources = {key: SOURCE_GPU for key in tensors}
    if want_intermediates:
        simulated = _run_reference(fam, config, inputs, causal, True, dtype)
        for key, value in simulated.items():
            if key not in tensors:
                tensors[key] = value
                sources[key] = SOURCE_REFERENCE
    return tensors, sources


# ----------------------------------------------------------------------------
# the protocols
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """What to measure: family, config, resolved backend, shape, dtype, seed, causal."""

    family: str = "int8"
    config: object = "default"
    backend: str = "reference"
    shape: Shape = field(default_factory=Shape)
    dtype: str = "fp16"
    seed: int = 0
    causal: bool = False

    def __post_init__(self):
        family(self.family)
        object.__setattr__(self, "config", resolve_config(self.family, self.config))
        if self.backend not in ("reference", "gpu"):
            raise ValueError(f"backend={self.backend!r} is not supported here; supported: reference, gpu "
                             f"(resolve 'auto' with resolve_backend first)")
        if not isinstance(self.shape, Shape):
            raise TypeError(f"shape must be a Shape, got {type(self.shape).__name__}")
        _check_dtype(self.dtype)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")


#: What the chunked exact attention gives (no (Nq, Nk) matrix among them): tensors of these keys only are computed
#: in O(N·D) memory per head (sagecupy.reference.attention.attention_chunked), whatever N.
_CHUNKED_KEYS = frozenset(("O", "lse", "delta", "dQ", "dK", "dV"))


def _exact(inputs: dict, causal: bool, keys: Iterable[str]) -> dict:
    """Exact float64 tensors ``keys`` on ``inputs``: by blocks (bounded memory) unless a key needs the whole P, dP
    or dS, which the dense form keeps."""
    from sagecupy.reference import attention as A

    keys = tuple(keys)
    q, k, v, do = (inputs[name] for name in LOAD_KEYS)
    if set(keys) <= _CHUNKED_KEYS:
        full = A.attention_chunked(q, k, v, do if set(keys) - {"O", "lse"} else None, causal=causal)
    else:
        full = A.attention_intermediates(q, k, v, do, causal=causal)
    return {key: full[key] for key in keys}


def _problem_sizes(spec: RunSpec, inputs: dict | None) -> tuple:
    """(B, Hq, Nq, Nk, D) of a measurement: from loaded ``inputs`` (HND) if given, else ``spec.shape`` (Nk = Nq)."""
    if inputs is not None:
        B, Hq, Nq, D = inputs["q"].shape
        return B, Hq, Nq, inputs["k"].shape[2], D
    B, Hq, Nq, D = spec.shape.hnd
    return B, Hq, Nq, Nq, D


def reference_peak_bytes(spec: RunSpec, *, intermediates: bool = False, inputs: dict | None = None) -> int:
    """Bytes the float64 side of a measurement holds at its peak: the family's simulator (run on the reference
    backend, and for the intermediates on either backend) and, for the intermediates, the dense exact ones (the
    σ-sweep's exact side is chunked: no (N, N) matrix). ``inputs`` (loaded files) give the shape; else
    ``spec.shape``."""
    from sagecupy.reference import attention as A

    B, Hq, Nq, Nk, D = _problem_sizes(spec, inputs)
    total = 0
    if spec.backend == "reference" or intermediates:
        module = importlib.import_module(family(spec.family).reference_module)
        if spec.family == "int8":
            total += module.peak_bytes(B, Hq, Nq, Nk, D, spec.config, intermediates=intermediates)
        else:
            total += module.peak_bytes(B, Hq, Nq, Nk, D, spec.config)
    if intermediates:
        total += A.dense_peak_bytes(B, Hq, Nq, Nk, D, kind="intermediates")
    return total


def check_reference_memory(spec: RunSpec, *, intermediates: bool = False, inputs: dict | None = None) -> None:
    """ValueError, before anything is drawn or run, if :func:`reference_peak_bytes` exceeds
    :data:`sagecupy.reference.attention.MEMORY_LIMIT` (the simulators would refuse the same call); the CLI prints
    it as one ``Error:`` line."""
    from sagecupy.reference import attention as A

    B, Hq, Nq, Nk, D = _problem_sizes(spec, inputs)
    parts = []
    if spec.backend == "reference" or intermediates:
        parts.append(f"the float64 {spec.family} simulator (dense (N, N) matrices)")
    if intermediates:
        parts.append("the dense exact intermediates")
    if parts:
        A.check_memory(f"{' and '.join(parts)} at B={B}, H={Hq}, Nq={Nq}, Nk={Nk}, D={D}",
                       reference_peak_bytes(spec, intermediates=intermediates, inputs=inputs))


def _measure(tensors: dict, exact: dict, keys: Iterable[str]) -> list[dict]:
    from sagecupy.reference.metrics import compare

    return [dict(tensor=key, **compare(tensors[key], exact[key])) for key in keys if key in tensors]


def _check_sigmas(sigmas) -> tuple[float, ...]:
    sigmas = tuple(_check_sigma(s) for s in sigmas)
    if not sigmas:
        raise ValueError("sigmas is empty; give at least one σ")
    return sigmas


def _tensors_of(fam: Family) -> tuple[str, ...]:
    return ACCURACY_TENSORS if fam.has_backward else ("O",)


def accuracy_sweep(spec: RunSpec, sigmas=SIGMAS, progress: Callable[[int], None] | None = None) -> list[dict]:
    """docs/algorithms.md §7.1 σ-sweep: for each σ, cos / rel_l2 / rel_l1 / rmse of O (dQ, dK, dV) vs exact.

    Returns one dict per (σ, tensor): ``type="accuracy", sigma, tensor, cos,
    rel_l2, rel_l1, rmse``. ``progress(1)`` is called after each σ.
    """
    sigmas = _check_sigmas(sigmas)
    fam = family(spec.family)
    keys = _tensors_of(fam)
    check_reference_memory(spec)
    records = []
    for sigma in sigmas:
        inputs = make_inputs(spec.shape, sigma, spec.seed, spec.dtype)
        tensors, _ = run_family(spec.backend, spec.family, spec.config, inputs, causal=spec.causal, dtype=spec.dtype)
        exact = _exact(inputs, spec.causal, keys)
        records += [dict(type="accuracy", sigma=sigma, **m) for m in _measure(tensors, exact, keys)]
        if progress is not None:
            progress(1)
    return records


def _worse(new: float, old, *, lower: bool) -> bool:
    """Whether ``new`` is a worse value than ``old`` (None: nothing yet); NaN is the worst value."""
    if old is None:
        return True
    if math.isnan(old):
        return False
    if math.isnan(new):
        return True
    return new < old if lower else new > old


def worst_case(records: Iterable[dict]) -> list[dict]:
    """The worst of a σ-sweep per tensor: the lowest ``cos`` and the highest ``rel_l2`` over σ.

    ``records``: :func:`accuracy_sweep`'s. Returns one dict per tensor, in the
    order they first appear: ``tensor, cos, cos_sigma, rel_l2, rel_l2_sigma``
    (the σ each worst value came from). A NaN counts as the worst value.
    """
    worst: dict = {}
    for rec in records:
        if rec.get("type") != "accuracy":
            continue
        w = worst.setdefault(rec["tensor"], dict(tensor=rec["tensor"], cos=None, cos_sigma=None, rel_l2=None,
                                                 rel_l2_sigma=None))
        if _worse(float(rec["cos"]), w["cos"], lower=True):
            w.update(cos=float(rec["cos"]), cos_sigma=rec["sigma"])
        if _worse(float(rec["rel_l2"]), w["rel_l2"], lower=False):
            w.update(rel_l2=float(rec["rel_l2"]), rel_l2_sigma=rec["sigma"])
    return list(worst.values())


def check_smoothing(spec: RunSpec) -> None:
    """ValueError unless ``spec.config`` has ``k_smoothing`` and ``q_smoothing`` fields (int8, nvfp4)."""
    names = {f.name for f in dataclasses.fields(spec.config)}
    if not {"k_smoothing", "q_smoothing"} <= names:
        raise ValueError(f"family {spec.family!r} has no smoothing options; the ablation applies to int8 and nvfp4")


def smoothing_ablation(spec: RunSpec, sigmas=SIGMAS,
                       progress: Callable[[int], None] | None = None) -> list[dict]:
    """docs/algorithms.md §7.3 smoothing ablation: the σ-sweep for each of :data:`SMOOTHING_VARIANTS`.

    For families whose config has ``k_smoothing`` / ``q_smoothing`` (int8,
    nvfp4); the other fields of ``spec.config`` are kept. Returns one dict per
    (variant, σ, tensor): ``type="smoothing", smoothing, k_smoothing,
    q_smoothing, sigma, tensor, cos, rel_l2, rel_l1, rmse``. ``progress(1)``
    after each (variant, σ).
    """
    sigmas = _check_sigmas(sigmas)
    check_smoothing(spec)
    records = []
    for variant, k_smooth, q_smooth in SMOOTHING_VARIANTS:
        config = dataclasses.replace(spec.config, k_smoothing=k_smooth, q_smoothing=q_smooth)
        sub = dataclasses.replace(spec, config=config)
        for rec in accuracy_sweep(sub, sigmas, progress):
            rec.update(type="smoothing", smoothing=variant, k_smoothing=k_smooth, q_smoothing=q_smooth)
            records.append({key: rec[key] for key in ("type", "smoothing", "k_smoothing", "q_smoothing", "sigma",
                                                      "tensor", "cos", "rel_l2", "rel_l1", "rmse")})
    return records


def intermediates(spec: RunSpec, sigma: float = 1.0, inputs: dict | None = None,
                  progress: Callable[[int], None] | None = None) -> list[dict]:
    """docs/algorithms.md §7.2 intermediates: every tensor of the computation vs float64 exact, plus the dS bound.

    ``inputs``: HND float64 ``dict(q, k, v, do)`` (e.g. from :func:`load_inputs`);
    ``None`` draws the σ-sweep inputs at ``sigma`` with ``spec.shape`` and ``spec.seed``.

    Returns one ``type="intermediate"`` dict per tensor the family has (order of
    :data:`INTERMEDIATE_TENSORS`): ``tensor, source, cos, rel_l2, rel_l1, rmse,
    rms`` (of the measured tensor), ``rms_exact``; then, for families with a
    backward, one ``type="ds_bound"`` dict: the docs/algorithms.md §4.5 bound
    ``max_j |dP_ij − δ_i| / sqrt(n_i)`` of every row of the exact computation
    (``bound_mean``, ``bound_max`` over rows) against the actual per-row RMS of
    the exact dS over the visible keys (``ds_row_rms_mean``, ``ds_row_rms_max``),
    ``tightness_mean`` = mean over rows of RMS / bound, ``bound_holds`` and, for
    scale, ``dp_rms`` = RMS of the exact dP. ``progress`` is called with 1
    after the measured run and 1 after the exact run.
    """
    from sagecupy.reference.attention import visible_mask
    from sagecupy.reference.metrics import ds_rms_bound, rms

    fam = family(spec.family)
    check_reference_memory(spec, intermediates=True, inputs=inputs)
    if inputs is None:
        inputs = make_inputs(spec.shape, sigma, spec.seed, spec.dtype)
    tensors, sources = run_family(spec.backend, spec.family, spec.config, inputs, causal=spec.causal,
                                  dtype=spec.dtype, want_intermediates=True)
    if progress is not None:
        progress(1)
    exact = _exact(inputs, spec.causal, INTERMEDIATE_TENSORS)
    if progress is not None:
        progress(1)
    records = []
    for m in _measure(tensors, exact, INTERMEDIATE_TENSORS):
        key = m.pop("tensor")
        records.append(dict(type="intermediate", tensor=key, source=sources[key], **m,
                            rms=rms(tensors[key]), rms_exact=rms(exact[key])))
    if fam.has_backward:
        nq, nk = exact["dP"].shape[-2:]
        visible = visible_mask(nq, nk, spec.causal)
        bound = ds_rms_bound(exact["dP"], exact["delta"], visible)
        n_visible = visible.sum(axis=-1)
        ds = np.where(visible, exact["dS"], 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            row_rms = np.sqrt((ds * ds).sum(axis=-1) / np.maximum(n_visible, 1))
            seen = np.broadcast_to(n_visible > 0, bound.shape) & (bound > 0)
            tight = (row_rms[seen] / bound[seen]) if seen.any() else np.zeros(1)
        records.append(dict(
            type="ds_bound", tensor="dS",
            bound_mean=float(bound.mean()), bound_max=float(bound.max()),
            ds_row_rms_mean=float(row_rms.mean()), ds_row_rms_max=float(row_rms.max()),
            tightness_mean=float(tight.mean()),
            bound_holds=bool(np.all(row_rms <= bound * (1 + 1e-12) + 1e-300)),
            dp_rms=rms(exact["dP"]),
        ))
    return records


def header(command: str, spec: RunSpec, *, backend_requested: str | None = None, backend_reason: str = "",
           sigmas=None, sigma=None, inputs: dict | None = None, source: str = "random") -> dict:
    """The environment header of a run: :func:`sagecupy._env.environment` plus what was run.

    ``inputs`` (when given) determines the reported shape, for loaded files.
    """
    from ._env import environment

    if inputs is not None:
        b, hq, nq, d = inputs["q"].shape
        hkv, nk = inputs["k"].shape[1:3]
    else:
        b, hq, nq, d = spec.shape.hnd
        hkv, nk = hq, nq
    head = {"type": "env", "command": command}
    head.update(environment())
    head.update(
        family=spec.family,
        backend=spec.backend,
        backend_requested=backend_requested or spec.backend,
        backend_reason=backend_reason,
        batch=b, heads=hq, heads_kv=hkv, n_q=nq, n_k=nk, d=d,
        dtype=spec.dtype, seed=spec.seed, causal=spec.causal,
        layout="HND", sm_scale=1.0 / math.sqrt(d),
        inputs=source,
        config=getattr(spec.config, "name", None),
        config_fields=_config_fields(spec.config),
    )
    if sigmas is not None:
        head["sigmas"] = list(sigmas)
    if sigma is not None:
        head["sigma"] = sigma
    return head
