#!/usr/bin/env bash
# SASS of one kernel instantiation, compiled with nvcc (sm_90a, -ftz=true as CuPy compiles), with ptxas's register,
# spill and stack lines and the local-memory instructions listed. Needs cuobjdump (a CUDA toolkit with it). Usage:
#   [KDIR=/tmp/old/kernels_cu] bash bench/tools/sass_of.sh FILE.cu "INSTANTIATION;" OUT.txt
# FILE.cu is a path under kernels_cu (e.g. int8/int8_attn_fwd_sm90.cu); INSTANTIATION names the kernel with its
# template arguments, e.g.
#   "const void* i[] = {(const void*)&int8_attn_fwd_sm90<__nv_bfloat16, 128, 4, 64>};"
# KDIR: another kernel tree (an earlier commit's: `git archive REV kernels_cu | tar -x -C /tmp/old`) for diffs.
# Caveat: CuPy builds the kernels with NVRTC at run time, whose code can differ from nvcc's for the same source
# (an ncu profile has shown address arithmetic that nvcc's cubin lacked): for what runs, read ncu's source page
# (bench/tools/profile.sh); this is for quick nvcc-level looks (registers, local memory).
set -eu
src=$1; inst=$2; out=$3
kdir=${KDIR:-$(cd "$(dirname "$0")/../../kernels_cu" && pwd)}
cuobj=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
tmp=$(mktemp -d)
printf '#include "%s/%s"\n%s\n' "$kdir" "$src" "$inst" > "$tmp/k.cu"
# -I the tree: includes name their headers from the kernel root ("common/mma.cuh")
nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -ftz=true -I"$kdir" -Xptxas -v -cubin -o "$tmp/k.cubin" \
  "$tmp/k.cu" 2>&1 | grep -E "registers|spill|stack" || true
"$cuobj" -sass "$tmp/k.cubin" > "$out"
echo "local memory instructions:"; grep -nE "LDL|STL" "$out" | head -20 || true
rm -rf "$tmp"
