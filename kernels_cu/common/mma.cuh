// Tensor-core and memory-movement primitives (inline PTX) shared by every kernel family.
// sm_80+: mma.sync, ldmatrix, cp.async. Nothing here depends on a kernel's tile shape.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace sage {

// D(16x8 s32) += A(16x32 u8, row) * B(32x8 s8, col). P and other non-negative operands are unsigned.
__device__ __forceinline__ void mma_u8s8(int (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D(16x8 s32) += A(16x32 s8, row) * B(32x8 s8, col).
__device__ __forceinline__ void mma_s8s8(int (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D(16x8 f32) += A(16x16 f16/bf16, row) * B(16x8, col).
template <typename T>
__device__ __forceinline__ void mma_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]);

template <>
__device__ __forceinline__ void mma_f16<__half>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_f16<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// addr through a volatile asm: the compiler keeps volatile asms (barriers, mbarrier waits) in order, so a plain asm
// load from the result (lds_f2, which it may otherwise move like arithmetic) stays after the barriers before it.
__device__ __forceinline__ unsigned after_barriers(unsigned addr) {
  unsigned r;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(addr));
  return r;
}

// Two floats from shared memory at byte address addr (ptxas folds a constant added to addr into the load). Not
// volatile and without a memory clobber: take addr from after_barriers when the data is written behind a barrier.
// Nothing keeps the load above the *next* barrier (after which the data may be overwritten) but its use: the
// result must feed work that the next barrier waits for (in the forward: P^, read by the tensor cores before it).
__device__ __forceinline__ float2 lds_f2(unsigned addr) {
  float2 v;
  asm("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}

// Four 8x8 b16 matrices (or 8 rows x 16 bytes each); lane l supplies the row address of
// matrix l/8, row l%8. Thread t receives row t/4, bytes 4*(t%4)..+3 of each matrix.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// As ldmatrix_x4, transposed: thread t receives, of each 8x8 b16 matrix, the elements (row 2(t%4), col t/4)
// and (row 2(t%4)+1, col t/4).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void cp_async_16(unsigned smem_addr, const void* gptr) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gptr));
}
// 16-byte cp.async that reads the first `src_bytes` (0..16) bytes and zero-fills the rest (0: reads nothing).
__device__ __forceinline__ void cp_async_16_n(unsigned smem_addr, const void* gptr, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gptr), "r"(src_bytes));
}
// As cp_async_16, but writes 16 zero bytes (reading nothing) when `valid` is false.
__device__ __forceinline__ void cp_async_16_zfill(unsigned smem_addr, const void* gptr, bool valid) {
  cp_async_16_n(smem_addr, gptr, valid ? 16 : 0);
}
// 8-byte cp.async (through L1), zero-filling when `valid` is false.
__device__ __forceinline__ void cp_async_8_zfill(unsigned smem_addr, const void* gptr, bool valid) {
  const int src_size = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr), "l"(gptr), "r"(src_size));
}
// 4-byte cp.async (through L1) of the first `src_bytes` (0..4) bytes, zero-filling the rest.
__device__ __forceinline__ void cp_async_4_n(unsigned smem_addr, const void* gptr, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gptr), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

}  // namespace sage
