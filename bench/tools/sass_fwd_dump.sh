# usage: bash sassdump.sh OUTDIR tree1 tree2 ...  (tree = path to a kernels_cu dir)
out=$1; shift
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
for t in "$@"; do
  name=$(basename $(dirname $t)); [ "$t" = kernels_cu ] && name=cur
  printf '#include "%s/int8_attn_fwd_sm90.cu"\nconst void* i[] = {(const void*)&int8_attn_fwd_sm90<__nv_bfloat16, 128, 4, 64>};\n' "$PWD/$t" > /tmp/w_$name.cu
  nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -cubin -o /tmp/w_$name.cubin /tmp/w_$name.cu && $CUOBJ -sass /tmp/w_$name.cubin > $out/sass_$name.txt
done
ls -la $out
