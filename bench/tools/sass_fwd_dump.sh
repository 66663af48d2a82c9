# nvcc's SASS of the INT8 wgmma forward (bf16, D = 128, 4 warps, 64-key tiles) for each kernel tree, on the GPU machine
# (cuobjdump is there, not here). Caveat: the kernel CuPy builds at run time is not this code: the eighteenth
# session's ncu profile showed address arithmetic per key-scale load that nvcc's cubin of the same source does not
# have. Read ncu's source page (bench/profile_sass.sh) for what runs; use this for quick nvcc-level diffs.
#   bash bench/tools/sass_fwd_dump.sh OUTDIR kernels_cu /tmp/old/kernels_cu ...
out=$1; shift
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
for t in "$@"; do
  name=$(basename $(dirname $t)); [ "$t" = kernels_cu ] && name=cur
  printf '#include "%s/int8_attn_fwd_sm90.cu"\nconst void* i[] = {(const void*)&int8_attn_fwd_sm90<__nv_bfloat16, 128, 4, 64>};\n' "$PWD/$t" > /tmp/w_$name.cu
  nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -cubin -o /tmp/w_$name.cubin /tmp/w_$name.cu && $CUOBJ -sass /tmp/w_$name.cubin > $out/sass_$name.txt
done
ls -la $out
