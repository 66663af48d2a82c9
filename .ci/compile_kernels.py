"""Compile every kernel instantiation without a GPU, two ways, and report registers and spills.

1. nvcc for sm_80 and sm_90a (``-Xptxas -v``): a wrapper translation unit includes the kernel file and
   takes the address of every instantiation the host code launches.
2. NVRTC (libnvrtc through ctypes, as CuPy does at run time) on the exact inlined source the loader
   builds, with the same name expressions: catches what only NVRTC rejects (no <math.h>, ...).

Exit status 1 on any compile error or serialized wgmma (ptxas C7514/C7515); wgmma serialized for want of
registers (C7512, a register-budget trade-off) is flagged on the function's line. ``--spill-fail`` also fails on
spills.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sagecupy import _layout, _loader, int8, nvfp4, qat  # noqa: E402

ARCHS = {"sm_80": "-gencode=arch=compute_80,code=sm_80", "sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}


def archs_for(filename):
    """Targets a source builds for: all of ARCHS unless the host module restricts it (wgmma: sm_90a)."""
    only = _layout.KERNEL_ARCHS.get(filename)
    return {a: f for a, f in ARCHS.items() if only is None or a in only}


def all_names() -> dict:
    names = {}
    for mod in (int8, nvfp4, qat):
        for f, lst in mod.kernel_names().items():
            names.setdefault(f, [])
            names[f] += [n for n in lst if n not in names[f]]
    return names


def nvcc_compile(nvcc, filename, names, arch_flag, tmp):
    wrapper = Path(tmp) / f"wrap_{filename.replace('/', '_')}"
    refs = ",\n  ".join(f"(const void*)&{n}" for n in names)
    # Host-side sizes that must equal the kernel's own constants (shared-memory layouts): a mismatch is a
    # compile error here instead of an out-of-bounds shared access on the GPU.
    checks = "".join(f'static_assert({expr} == {value}, "host value {value} of {expr} (sagecupy) differs");\n'
                     for expr, value in {**int8.kernel_constants(), **nvfp4.kernel_constants(),
                                         **qat.kernel_constants()}.get(filename, ()))
    wrapper.write_text(f'#include "{_loader.kernel_dir() / filename}"\n'
                       f"const void* sagecupy_instances[] = {{\n  {refs}\n}};\n{checks}")
    cmd = [nvcc, "-std=c++17", arch_flag, f"-I{_loader.kernel_dir()}", "-Xptxas", "-v", "-c", str(wrapper),
           "-o", str(Path(tmp) / "out.o")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def parse_ptxas(log):
    """[(function, registers, spill_stores, spill_loads, stack_frame)] from ptxas -v output."""
    out, cur, spills = [], None, (0, 0, 0)
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills = (int(m.group(2)), int(m.group(3)), int(m.group(1)))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            out.append((cur, int(m.group(1)), *spills))
            cur, spills = None, (0, 0, 0)
    return out


def demangle(names):
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return names
    r = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    return r.stdout.splitlines() if r.returncode == 0 else names


def find_nvrtc():
    cands = []
    for base in filter(None, [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]):
        cands += sorted(glob.glob(os.path.join(base, "lib64", "libnvrtc.so*")))
    for site in sys.path:  # pip wheels: nvidia-cuda-nvrtc (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib)
        cands += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
    lib = ctypes.util.find_library("nvrtc")
    if lib:
        cands.append(lib)
    for c in cands:
        if "builtins" in c or "alt" in c:
            continue
        try:
            for b in sorted(glob.glob(os.path.join(os.path.dirname(c), "libnvrtc-builtins.so*"))):
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)  # libnvrtc dlopens it by name
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


def nvrtc_compile(lib, filename, names, arch):
    src = _loader.kernel_source(filename).encode()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, filename.encode(), 0, None, None)
    if rc:
        return rc, f"nvrtcCreateProgram failed ({rc})"
    for n in names:
        lib.nvrtcAddNameExpression(prog, n.encode())
    opts = ["--std=c++17", f"--gpu-architecture={arch}"]
    inc = _loader.cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, buf.value.decode(errors="replace")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--spill-fail", action="store_true")
    ap.add_argument("--nvrtc-only", action="store_true", help="skip the (slower) nvcc pass")
    ap.add_argument("--only", default="", help="comma-separated source files to compile (default: all)")
    a = ap.parse_args(argv)
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        print("compile_kernels: nvcc not found; cannot check kernels", file=sys.stderr)
        return 1
    failed, spilled = False, False
    names = all_names()
    if a.only:
        keep = set(a.only.split(","))
        names = {f: lst for f, lst in names.items() if f in keep}
    with tempfile.TemporaryDirectory() as tmp:
        for filename, lst in (() if a.nvrtc_only else names.items()):
            for arch, flag in archs_for(filename).items():
                rc, log = nvcc_compile(nvcc, filename, lst, flag, tmp)
                if rc:
                    failed = True
                    print(f"FAIL nvcc {arch} {filename}:\n{log}")
                    continue
                # ptxas C7514/C7515: wgmma serialized (an accumulator or A register is touched while in
                # flight, or the pipeline crosses a call): the kernel runs, at a fraction of its speed.
                serial = sorted(set(re.findall(r"\(C751[45]\)[^\n]*", log)))
                if serial:
                    failed = True
                    print(f"FAIL nvcc {arch} {filename}: wgmma serialized\n  " + "\n  ".join(serial))
                # ptxas C7512: wgmma serialized for want of registers (the kernel's register budget): reported
                # per function, not a failure (a budget choice measured against the serialization it costs).
                short = set(re.findall(r"\(C7512\)[^'\n]*'([^'\n]+)'", log))
                rows = parse_ptxas(log)
                for (fn, regs, st, ld, stack), pretty in zip(rows, demangle([r[0] for r in rows])):
                    # a stack frame without spills: a local array indexed at run time (a loop not unrolled)
                    flag_s = (("  SPILLS" if (st or ld) else "") + ("  STACK" if stack and not (st or ld) else "")
                              + ("  WGMMA-SERIALIZED(C7512)" if fn in short else ""))
                    spilled |= bool(st or ld)
                    print(f"ok   nvcc {arch:<7} {filename:<26} regs={regs:<4} spill_st={st:<5} spill_ld={ld:<5} "
                          f"stack={stack:<5} {pretty[:90]}{flag_s}")
    lib = find_nvrtc()
    if lib is None:
        print("NVRTC not found: skipped the NVRTC pass")
    else:
        for filename, lst in names.items():
            for arch in archs_for(filename):
                rc, log = nvrtc_compile(lib, filename, lst, arch)
                if rc:
                    failed = True
                    print(f"FAIL nvrtc {arch} {filename}:\n{log}")
                else:
                    print(f"ok   nvrtc {arch:<7} {filename} ({len(lst)} instantiations)")
    if failed:
        return 1
    if spilled and a.spill_fail:
        print("spills present and --spill-fail given")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
