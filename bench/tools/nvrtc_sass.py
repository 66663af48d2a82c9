"""The machine code CuPy's NVRTC build gives a kernel (it differs from nvcc's: the ncu profile of the INT8 forward
showed per-load address arithmetic that nvcc's cubin does not have), for A/B reading of kernel trees. On the GPU
machine, per tree: a fresh CuPy cache directory, one small INT8 forward (wgmma) to compile, then cuobjdump -sass of the
cached cubins, keeping the functions whose name matches the regex:

    python bench/tools/nvrtc_sass.py OUTDIR [--kernel int8_attn_fwd_sm90<__nv_bfloat16, 128, 4, 64>] TREE [TREE ...]

TREE: a kernels_cu directory ('' or 'default': the package's own). Writes OUTDIR/nvrtc_<n>.sass per tree.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import cupy
from sagecupy import int8
from sagecupy.bf16 import BF16Array
rng = cupy.random.default_rng(0)
q, k, v = (BF16Array.from_float(rng.standard_normal((1, 2, 256, 128), dtype=cupy.float32)) for _ in range(3))
int8.forward(q, k, v, engine="wgmma")
cupy.cuda.Device().synchronize()
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--kernel", default="int8_attn_fwd_sm90<__nv_bfloat16, 128, 4, 64>")
    a = ap.parse_args()
    cuobjdump = "cuobjdump" if subprocess.run(["which", "cuobjdump"], capture_output=True).returncode == 0 \
        else "/usr/local/cuda/bin/cuobjdump"
    for i, tree in enumerate(a.trees):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, CUPY_CACHE_DIR=cache)
            env.pop("SAGECUPY_KERNELS_DIR", None)
            if tree not in ("", "default"):
                env["SAGECUPY_KERNELS_DIR"] = str(Path(tree).resolve())
            subprocess.run([sys.executable, "-c", CHILD], env=env, check=True)
            text = []
            for f in Path(cache).rglob("*"):
                if not f.is_file():
                    continue
                data = f.read_bytes()
                at = data.find(b"\x7fELF")
                if at < 0:
                    continue
                cub = Path(cache) / "x.cubin"
                cub.write_bytes(data[at:])
                r = subprocess.run([cuobjdump, "-sass", str(cub)], capture_output=True, text=True)
                # sections start at "Function : <mangled>"; keep those whose demangled name matches
                for sec in re.split(r"\n(?=\s*Function : )", r.stdout):
                    m = re.search(r"Function : (\S+)", sec)
                    if not m:
                        continue
                    name = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout.strip()
                    if a.kernel in name:
                        text.append(f"== {name}\n{sec}\n")
            Path(a.out, f"nvrtc_{i}.sass").write_text("".join(text) or "no matching function\n")
            print(tree or "default", "->", f"nvrtc_{i}.sass", sum(t.count("\n") for t in text), "lines")


if __name__ == "__main__":
    main()
