// Test kernels for common/wgmma.cuh's 16-bit register-A products with an MN-major ("transposed") B operand,
// the form the QAT backward uses for P^T dO, dS^T Q~ and dS K~ (tests/gpu/test_wgmma_operands.py).
#include "common/tile.cuh"
#include "common/wgmma.cuh"

using namespace sage;

// C (64 x N fp32, row-major) = A (64 x 64, row-major) B (64 x N, row-major), one warpgroup. A goes to registers
// through ldmatrix (the m16n8k16 A fragment), B to shared memory as a [K][N] tile in 128-byte pieces, read
// through desc_mn16.
template <typename T, int N>
__global__ void __launch_bounds__(128) wgmma_rs_mn_product(const T* __restrict__ a, const T* __restrict__ b,
                                                           float* __restrict__ c) {
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sA = smem;         // 64 rows x 128 bytes, swizzled
  char* sB = smem + 8192;  // 64 rows (k) x N, in 128-byte pieces
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  load_tile_async<64, 128, 128>(sA, reinterpret_cast<const char*>(a), 128, tid);
  const TileCopy<64, 2 * N, 128, true> cb(tid);
  cb.copy(sB, reinterpret_cast<const char*>(b), 2 * N);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  unsigned af[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) ldsm_x4<128, true>(af[kk], sA, warp * 16, 2 * kk, lane);
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    wgmma_rs<T, true>(acc, af[kk], desc_mn16<64>(sB, kk), kk);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(acc);
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      c[(warp * 16 + g + 8 * (e >> 1)) * N + 8 * j + 2 * t4 + (e & 1)] = acc[4 * j + e];
}

// C (64 x 64 fp32) = A (64 x 64) B (64 x 64), both operands from shared memory (wgmma_ss), one of them MN-major:
// A_MN: `a` holds A^T ([k][m], read M-major through desc_mn16) and `b` holds B^T ([n][k], K-major); otherwise `a`
// holds A ([m][k], K-major) and `b` holds B ([k][n], read N-major). The QAT backward's dP^T = V~ dO^T (V~ from its
// V~^T tile) and dP = dO V~^T are these two forms.
template <typename T, bool A_MN>
__global__ void __launch_bounds__(128) wgmma_ss_mn_product(const T* __restrict__ a, const T* __restrict__ b,
                                                           float* __restrict__ c) {
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sA = smem;
  char* sB = smem + 8192;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const TileCopy<64, 128, 128, true> cp(tid);
  cp.copy(sA, reinterpret_cast<const char*>(a), 128);
  cp.copy(sB, reinterpret_cast<const char*>(b), 128);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    if constexpr (A_MN)
      wgmma_ss<T, true, false>(acc, desc_mn16<64>(sA, ks), desc_k16<64>(sB, ks), ks);
    else
      wgmma_ss<T, false, true>(acc, desc_k16<64>(sA, ks), desc_mn16<64>(sB, ks), ks);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(acc);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[(warp * 16 + g + 8 * (e >> 1)) * 64 + 8 * j + 2 * t4 + (e & 1)] = acc[4 * j + e];
}
