"""bfloat16 on the device: CuPy arrays of ``ml_dtypes.bfloat16`` where CuPy has that dtype, :class:`BF16Array`
where it has not.

CuPy holds arrays of ``ml_dtypes.bfloat16`` from version 14 on (with NumPy 2.1.2 or newer, and ``ml_dtypes``
installed): such an array is a first-class input of every sagecupy function that takes bf16, and the outputs of
a call with such inputs are CuPy bfloat16 arrays too. The kernels see the same memory either way: the host code
reinterprets a bfloat16 array as its uint16 bits (``.view``, no copy) and an output's bits as bfloat16.

:class:`BF16Array` holds the raw bits in a ``uint16`` CuPy array and says it is bfloat16, for a CuPy (or an
environment) without that dtype; a call whose inputs are ``BF16Array`` returns ``BF16Array`` outputs.
A plain ``uint16`` array is never taken for bfloat16 (that would silently compute on integers).

    x = from_float(cupy_float32_array)   # round to nearest even: a bfloat16 array, or a BF16Array
    y = to_float32(x)                     # exact widening, either form

Which form an output takes (:func:`output_kind`): that of the input it follows (``q`` in a forward, ``do`` in a
backward); with no bf16 input to follow (``nvfp4.attention_packed(out_dtype="bfloat16")``, the helpers below),
native where CuPy has bfloat16 (:func:`native_dtype`), else ``BF16Array``.
"""
from __future__ import annotations

import re

__all__ = ["BF16Array", "DTYPE_NAME", "NATIVE", "WRAPPED", "native_dtype", "native_supported", "is_native",
           "is_bf16", "output_kind", "bits_of", "from_bits", "from_float", "to_float32"]

DTYPE_NAME = "bfloat16"
#: The two forms of a bf16 device array (:func:`output_kind`): a CuPy array of ``ml_dtypes.bfloat16``, a BF16Array.
NATIVE, WRAPPED = "native", "BF16Array"
#: The oldest CuPy with ``ml_dtypes.bfloat16`` arrays, and the oldest NumPy it enables them with (CuPy leaves
#: them out on older NumPy, whose result-type handling crashed with the bfloat16 loops).
CUPY_MIN_MAJOR, NUMPY_MIN = 14, "2.1.2"


def native_supported(cupy_version: str, numpy_version: str, have_ml_dtypes: bool) -> bool:
    """Whether CuPy ``cupy_version`` holds ``ml_dtypes.bfloat16`` arrays beside NumPy ``numpy_version`` (pure: the
    decision of :func:`native_dtype`)."""
    m = re.match(r"\s*(\d+)", str(cupy_version))
    if not have_ml_dtypes or m is None or int(m.group(1)) < CUPY_MIN_MAJOR:
        return False
    from numpy.lib import NumpyVersion

    try:
        return NumpyVersion(str(numpy_version)) >= NUMPY_MIN
    except ValueError:  # a version string NumpyVersion cannot read
        return False


_NATIVE = [None, None]  # [the cupy module probed, its answer]: re-probed when another cupy module is imported (tests)


def native_dtype():
    """``numpy.dtype(ml_dtypes.bfloat16)`` where CuPy holds arrays of it (:func:`native_supported`), else None.
    Decided once per imported ``cupy`` module; None where CuPy or ml_dtypes is not importable."""
    try:
        import cupy
    except ImportError:
        return None
    if _NATIVE[0] is not cupy:
        dt = None
        try:
            import ml_dtypes
            import numpy
        except ImportError:
            ml_dtypes = None
        if ml_dtypes is not None and native_supported(getattr(cupy, "__version__", ""), numpy.__version__, True):
            dt = numpy.dtype(ml_dtypes.bfloat16)
        _NATIVE[:] = [cupy, dt]
    return _NATIVE[1]


def is_native(x) -> bool:
    """Whether ``x`` is a bfloat16 array in the dtype's own form (a CuPy array of ``ml_dtypes.bfloat16``; any
    array-like whose dtype is named bfloat16 and is not a :class:`BF16Array`)."""
    if isinstance(x, BF16Array):
        return False
    dt = getattr(x, "dtype", None)
    return getattr(dt, "kind", None) == "V" and getattr(dt, "name", None) == DTYPE_NAME


def is_bf16(x) -> bool:
    """Whether ``x`` holds bfloat16 in either form."""
    return isinstance(x, BF16Array) or is_native(x)


def output_kind(like=None, native_available: bool | None = None) -> str:
    """The form (:data:`NATIVE` or :data:`WRAPPED`) of a bf16 output that follows the input ``like``: ``like``'s own
    form; with no bf16 ``like`` (None, or another dtype), :data:`NATIVE` where ``native_available`` (default:
    :func:`native_dtype` is not None), else :data:`WRAPPED`."""
    if isinstance(like, BF16Array):
        return WRAPPED
    if is_native(like):
        return NATIVE
    if native_available is None:
        native_available = native_dtype() is not None
    return NATIVE if native_available else WRAPPED


def bits_of(x):
    """The uint16 CuPy array holding a bfloat16 array's bits (either form): a view, no copy."""
    if isinstance(x, BF16Array):
        return x.bits
    if not is_native(x):
        raise TypeError(f"expected a bfloat16 array (a CuPy array of ml_dtypes.bfloat16 or a BF16Array), got "
                        f"{type(x).__name__} {getattr(x, 'dtype', '')}")
    import numpy

    return x.view(numpy.uint16)


def from_bits(bits, like=None):
    """uint16 CuPy bits as a bfloat16 array of the form :func:`output_kind` gives for ``like``: a view (``like``'s
    dtype, or :func:`native_dtype`) or a :class:`BF16Array` around ``bits``; no copy."""
    import numpy

    if getattr(bits, "dtype", None) != numpy.uint16:  # a view would reinterpret any other type silently
        raise TypeError(f"from_bits: bits must be a uint16 array of bfloat16 bit patterns, got "
                        f"{getattr(bits, 'dtype', type(bits).__name__)}")
    if output_kind(like) == WRAPPED:
        return BF16Array(bits)
    return bits.view(like.dtype if is_native(like) else native_dtype())


def from_float(x, like=None):
    """A CuPy float array rounded to bfloat16 (as :meth:`BF16Array.from_float`: nearest even, NaN stays NaN), in
    the form :func:`output_kind` gives for ``like``."""
    return from_bits(BF16Array.from_float(x).bits, like)


def to_float32(x):
    """A bfloat16 array (either form; a NumPy one too) as float32 values in the same array library: exact
    (bfloat16 is float32's top half)."""
    import numpy

    return (bits_of(x).astype(numpy.uint32) << 16).view(numpy.float32)


class _BF16Dtype:
    name = DTYPE_NAME
    itemsize = 2
    kind = "V"

    def __repr__(self):
        return "bfloat16"

    def __eq__(self, other):
        return isinstance(other, _BF16Dtype) or other == DTYPE_NAME

    def __hash__(self):
        return hash(DTYPE_NAME)


class BF16Array:
    """bfloat16 data in device memory: ``bits`` is a uint16 CuPy array (any strides)."""

    dtype = _BF16Dtype()
    itemsize = 2

    def __init__(self, bits):
        import cupy

        if not isinstance(bits, cupy.ndarray) or bits.dtype != cupy.uint16:
            raise TypeError(f"BF16Array needs a uint16 CuPy array of raw bits, got "
                            f"{type(bits).__name__} {getattr(bits, 'dtype', '')}")
        self.bits = bits

    # --- construction / conversion -------------------------------------------------------------
    @classmethod
    def empty(cls, shape):
        import cupy

        return cls(cupy.empty(shape, dtype=cupy.uint16))

    @classmethod
    def from_float(cls, x):
        """Round a CuPy float array to bfloat16 (nearest, ties to even; NaN stays NaN). Input is taken as
        float32 (a float64 array is first rounded to float32, so it is rounded twice)."""
        import cupy

        f = cupy.ascontiguousarray(x, dtype=cupy.float32)
        u = f.view(cupy.uint32)
        rounded = (u + cupy.uint32(0x7FFF) + ((u >> 16) & cupy.uint32(1))) >> 16
        nan = cupy.isnan(f)
        bits = cupy.where(nan, (u >> 16) | cupy.uint32(0x40), rounded).astype(cupy.uint16)
        return cls(bits)

    def to_float32(self):
        import cupy

        return (self.bits.astype(cupy.uint32) << 16).view(cupy.float32)

    def get(self):
        """Host copy as float32 NumPy (exact; NumPy has no bfloat16 of its own)."""
        return self.to_float32().get()

    # --- the small ndarray surface the library uses ------------------------------------------
    @property
    def shape(self):
        return self.bits.shape

    @property
    def strides(self):
        return self.bits.strides

    @property
    def ndim(self):
        return self.bits.ndim

    @property
    def size(self):
        return self.bits.size

    @property
    def data(self):
        return self.bits.data

    def copy(self):
        return BF16Array(self.bits.copy())

    def __getitem__(self, idx):
        return BF16Array(self.bits[idx])

    def transpose(self, *axes):
        return BF16Array(self.bits.transpose(*axes))

    def __repr__(self):
        return f"BF16Array(shape={self.shape})"
