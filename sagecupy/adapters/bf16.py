"""bfloat16 on the device for a CuPy that has no bfloat16 dtype (CuPy 14 has none).

:class:`BF16Array` holds the raw bits in a ``uint16`` CuPy array and says it is bfloat16; the
kernels take its memory as ``__nv_bfloat16``. Every sagecupy function that accepts bf16 takes a
``BF16Array`` and returns ``BF16Array`` outputs for bf16 inputs. A plain ``uint16`` array is never
taken for bfloat16 (that would silently compute on integers).

    x = BF16Array.from_float(cupy_float32_array)   # round to nearest even
    y = x.to_float32()                               # exact widening
"""
from __future__ import annotations

__all__ = ["BF16Array", "DTYPE_NAME"]

DTYPE_NAME = "bfloat16"


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
        """Host copy as float32 NumPy (NumPy has no bfloat16 either)."""
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
