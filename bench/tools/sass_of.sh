#!/usr/bin/env bash
# SASS of one kernel instantiation, compiled with nvcc as CuPy would (sm_90a, -ftz=true), for reading on the GPU
# machine (this repository's CI machine has no cuobjdump). Usage:
#   bash bench/tools/sass_of.sh int8_quant.cu "template __global__ void quant_rows_qk<__nv_bfloat16, 128, 8>(...);" OUT.txt
# (the second argument: an explicit instantiation of the kernel, with its parameter types).
set -eu
src=$1; inst=$2; out=$3
tmp=$(mktemp -d)
printf '#include "%s"\n%s\n' "$src" "$inst" > "$tmp/k.cu"
nvcc -std=c++17 -I"$(dirname "$0")/../../kernels_cu" -gencode arch=compute_90a,code=sm_90a -ftz=true -Xptxas -v \
  -cubin -o "$tmp/k.cubin" "$tmp/k.cu" 2>&1 | grep -E "registers|spill|stack" || true
cuobjdump -sass "$tmp/k.cubin" > "$out"
echo "local memory instructions:"; grep -nE "LDL|STL" "$out" | head -20 || true
rm -rf "$tmp"
