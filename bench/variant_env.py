"""One variant of a `--defines` list (bench/fwd_variants.py, bwd_variants.py, fp4_d64_variants.py,
prepass_variants.py, ab_time.py) into the environment.

A variant is comma-separated tokens: kernel defines (into SAGECUPY_DEFINES) and tokens named SAGECUPY_* that are set
as environment variables instead (host switches, or SAGECUPY_KERNELS_DIR=/path/kernels_cu to time another kernel
tree, e.g. an earlier commit's: `git archive HEAD kernels_cu | tar -x -C /tmp/base`). The previous variant's
variables are unset first; set_variant(None) unsets them all.
"""
import os

_ENV = {}


def set_variant(dfn):
    for k in _ENV:
        os.environ.pop(k, None)
    _ENV.clear()
    if dfn is None:
        os.environ.pop("SAGECUPY_DEFINES", None)
        return
    tokens = [t for t in dfn.split(",") if t]
    _ENV.update(t.split("=", 1) for t in tokens if t.startswith("SAGECUPY_"))
    os.environ.update(_ENV)
    os.environ["SAGECUPY_DEFINES"] = ",".join(t for t in tokens if not t.startswith("SAGECUPY_"))
