"""How fast can a fused INT8 backward accumulate dQ with reductions to global memory?

A fused dK/dV/dQ kernel (one CTA per key block, looping over query tiles) adds each (key block, query tile)
partial dQ, a BQ x D fp32 tile, into an fp32 accumulator in device memory. This probe issues exactly that
traffic with no arithmetic around it, at the benchmark's shape (B*H = 64 heads, N = 4096, D = 128), so the
reduction's own cost can be compared with the split backward's dQ kernel (the thing it would replace):

  red-v2     red.global.add.v2.f32 from the accumulator layout (a thread holds pairs of adjacent columns)
  red-f32    scalar red.global.add.f32, the same elements
  bulk       the tile written to shared memory, then one cp.reduce.async.bulk .add.f32 of the whole
             contiguous BQ x D tile (a bulk-copy-engine reduction)
  store      plain st.global.v2 of the same bytes (not a reduction: the bandwidth ceiling for reference)

for key blocks of 64 and 128 keys (the number of partial tiles per query tile halves with 128).
Run: python bench/atomic_probe.py  (needs a GPU; prints ms per variant and the implied GB/s).
"""
import sys

import cupy as cp

SRC = r"""
extern "C" __global__ void __launch_bounds__(128) probe(float* __restrict__ acc, int nqt, int mode) {
  // grid (key blocks, B*H); the CTA adds one 64 x 128 tile per query tile into acc[bh][qt*64 + r][c].
  extern __shared__ __align__(128) float tile[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  float* base = acc + (long long)blockIdx.y * nqt * 64 * 128;
  const float v = 1.0f + blockIdx.x * 1e-3f;
  for (int qt = 0; qt < nqt; ++qt) {
    float* t = base + (long long)qt * 64 * 128;
    if (mode == 3) {
      // bulk: write the tile to shared memory, one thread reduces it into global memory
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      __syncthreads();
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = warp * 16 + g + 8 * r, col = 8 * j + 2 * t4;
          *reinterpret_cast<float2*>(tile + row * 128 + col) = make_float2(v, v);
        }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      if (tid == 0) {
        const unsigned s = (unsigned)__cvta_generic_to_shared(tile);
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                     :: "l"(t), "r"(s), "r"(64 * 128 * 4) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      }
      continue;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g + 8 * r, col = 8 * j + 2 * t4;
        float* p = t + row * 128 + col;
        if (mode == 0) {
          asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(v), "f"(v) : "memory");
        } else if (mode == 1) {
          asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(p), "f"(v) : "memory");
          asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(p + 1), "f"(v) : "memory");
        } else {
          *reinterpret_cast<float2*>(p) = make_float2(v, v);
        }
      }
  }
  if (mode == 3 && tid == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
"""


def split_times():
    """The split backward's two kernels timed apart (wgmma engine), D = 128, the benchmark's shapes."""
    from sagecupy import bench, int8

    for n in (4096, 16384):
        for causal in (False, True):
            B, H, (q, k, v, do) = bench._inputs(128, n, "bfloat16")
            o, res = int8.forward(q, k, v, causal=causal)
            pre = int8._preprocess_backward(res, do)
            t = {which: bench.time_ms(lambda: int8._launch_backward(res, pre, "wgmma", kernels=which))
                 for which in (("dkdv",), ("dq",), ("dkdv", "dq"))}
            print(f"  N={n:5d} causal={int(causal)}  dK/dV {t[('dkdv',)]:.3f} ms  dQ {t[('dq',)]:.3f} ms  "
                  f"both {t[('dkdv', 'dq')]:.3f} ms  (B={B} H={H})")


def main():
    mod = cp.RawModule(code=SRC, options=("--std=c++17",), backend="nvrtc")
    fn = mod.get_function("probe")
    fn.max_dynamic_shared_size_bytes = 64 * 128 * 4
    BH, N = 64, 4096
    nqt = N // 64
    acc = cp.zeros((BH, N, 128), dtype=cp.float32)
    names = {0: "red-v2", 1: "red-f32", 2: "store", 3: "bulk"}
    print(f"B*H={BH} N={N} D=128: one 64 x 128 fp32 tile per (key block, query tile)")
    for bkv in (64, 128):
        nkb = N // bkv
        gbytes = BH * nkb * nqt * 64 * 128 * 4 / 1e9
        for mode in (0, 1, 3, 2):
            def run():
                fn((nkb, BH), (128,), (acc, cp.int32(nqt), cp.int32(mode)), shared_mem=64 * 128 * 4 if mode == 3 else 0)
            for _ in range(2):
                run()
            cp.cuda.Device().synchronize()
            s, e = cp.cuda.Event(), cp.cuda.Event()
            ts = []
            for _ in range(5):
                s.record()
                run()
                e.record()
                e.synchronize()
                ts.append(cp.cuda.get_elapsed_time(s, e))
            ms = sorted(ts)[2]
            print(f"  key block {bkv:3d}  {names[mode]:8s} {ms:7.3f} ms  {gbytes:6.2f} GB  {gbytes / ms:7.1f} GB/ms")
    # correctness of the reductions (each element gets nkb adds of its block's value)
    acc.fill(0)
    nkb = N // 64
    fn((nkb, BH), (128,), (acc, cp.int32(nqt), cp.int32(0)))
    want = sum(1.0 + b * 1e-3 for b in range(nkb))
    print("red-v2 sum check:", float(abs(acc - want).max()), "(want ~0)")
    acc.fill(0)
    fn((nkb, BH), (128,), (acc, cp.int32(nqt), cp.int32(3)), shared_mem=64 * 128 * 4)
    print("bulk sum check:", float(abs(acc - want).max()), "(want ~0)")
    del acc
    print("split INT8 backward, kernels alone:")
    split_times()
    return 0


if __name__ == "__main__":
    sys.exit(main())
