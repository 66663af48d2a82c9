#!/usr/bin/env bash
# SASS of one kernel instantiation, compiled with nvcc (sm_90a, -ftz=true as CuPy compiles), on the GPU machine
# (cuobjdump is there, not on the CI machine). Usage:
#   [KDIR=/tmp/old/kernels_cu] bash bench/tools/sass_of.sh FILE.cu "INSTANTIATION;" OUT.txt
# INSTANTIATION names the kernel with its template arguments, e.g.
#   "const void* i[] = {(const void*)&int8_attn_fwd_sm90<__nv_bfloat16, 128, 4, 64>};"
# KDIR: another kernel tree (an earlier commit's: `git archive REV kernels_cu | tar -x -C /tmp/old`) for diffs.
# Caveat: NVRTC's build at run time can differ from nvcc's (the eighteenth session's ncu profile showed key-scale
# address arithmetic that nvcc's cubin of the same source lacks): read ncu's source page (bench/profile_sass.sh) for
# what runs, and this for quick nvcc-level looks (registers, local memory).
set -eu
src=$1; inst=$2; out=$3
kdir=${KDIR:-$(cd "$(dirname "$0")/../../kernels_cu" && pwd)}
cuobj=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
tmp=$(mktemp -d)
printf '#include "%s/%s"\n%s\n' "$kdir" "$src" "$inst" > "$tmp/k.cu"
nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -ftz=true -Xptxas -v -cubin -o "$tmp/k.cubin" "$tmp/k.cu" 2>&1 \
  | grep -E "registers|spill|stack" || true
"$cuobj" -sass "$tmp/k.cubin" > "$out"
echo "local memory instructions:"; grep -nE "LDL|STL" "$out" | head -20 || true
rm -rf "$tmp"
