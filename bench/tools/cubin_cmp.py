"""Whether two kernel trees compile to the same machine code: every instantiation the host launches, per kernel
file and target (nvcc sm_80 / sm_90a, as .ci/compile_kernels.py builds them), compared by the SHA-256 of the cubin.
For edits meant to change no code (comments, formatting): same cubins, so a GPU run of the old tree stands.

    git archive REV kernels_cu | tar -x -C /tmp/old
    python bench/tools/cubin_cmp.py /tmp/old/kernels_cu [FILE.cu ...] [--each]

FILE.cu: a source as .ci/compile_kernels.py names it (its path under kernels_cu, e.g. int8/int8_quant.cu); default:
every source that script compiles. An old tree from before a source moved into a family folder is read at the
source's old place (its bare file name at the tree's top), so a move that changes no code compares as the same.
--each: one cubin per instantiation (which template instances changed); an instance the old tree does not have
(a new kernel) is listed as NEW and not counted.
--old-defines SAGE_X=1,SAGE_Y=0: compile the old tree with these defines (as SAGECUPY_DEFINES passes them): e.g. the
tree before a switch's default was flipped, with the switch on, against the flipped tree.
"""
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / ".ci")]

import compile_kernels as ck  # noqa: E402


def source_path(tree, filename):
    """Where ``filename`` (a path under kernels_cu) is in ``tree``: there, or at the top of a tree from before the
    sources moved into family folders."""
    path = Path(tree) / filename
    if not path.is_file() and (Path(tree) / Path(filename).name).is_file():
        return Path(tree) / Path(filename).name
    return path


def cubin_digest(tree, filename, names, flag, tmp, missing_ok=False, defines=()):
    wrap = Path(tmp) / "wrap.cu"  # the same path for both trees
    refs = ",\n  ".join(f"(const void*)&{n}" for n in names)
    wrap.write_text(f'#include "{source_path(tree, filename)}"\nconst void* sagecupy_instances[] = {{\n  {refs}\n}};\n')
    out = Path(tmp) / "k.cubin"
    # -I the tree: includes name their headers from the kernel root ("common/mma.cuh"), as the loader resolves them
    r = subprocess.run(["nvcc", "-std=c++17", flag, f"-I{tree}", *(f"-D{d}" for d in defines), "-cubin", "-o",
                        str(out), str(wrap)], capture_output=True, text=True)
    if r.returncode:
        if missing_ok:
            return None
        raise SystemExit(f"{tree}/{filename}: nvcc failed\n{r.stderr[-2000:]}")
    return hashlib.sha256(out.read_bytes()).hexdigest()


def main():
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    defines = ()
    if "--old-defines" in argv:
        i = argv.index("--old-defines")
        defines = tuple(d for d in argv[i + 1].split(",") if d)
        del argv[i:i + 2]
    args = [a for a in argv if a != "--each"]
    each = len(args) < len(argv)
    old = Path(args[0]).resolve()
    names = ck.all_names()
    files = args[1:] or sorted(names)
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            for arch, flag in ck.archs_for(f).items():
                for group in ([[n] for n in names[f]] if each else [names[f]]):
                    a = cubin_digest(old, f, group, flag, tmp, missing_ok=each, defines=defines)
                    b = cubin_digest(ROOT / "kernels_cu", f, group, flag, tmp)
                    if a is None:
                        print("NEW", arch, f, group[0], flush=True)
                        continue
                    differ += a != b
                    print("same" if a == b else "DIFFERS", arch, f, group[0] if each else "", flush=True)
    print(f"{differ} of the cubins differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
