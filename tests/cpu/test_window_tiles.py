"""The INT8 kernels' window bookkeeping (kernels_cu/common/rows.cuh: Window, key_range, the window query_tiles),
compiled for the host with the C++ compiler and checked exhaustively over small sequences against the window's
definition (docs/algorithms.md §1.8), with the (left, right) the host passes (sagecupy.int8.kernel_window):

* forward and dQ CTAs (64 rows; 64- and 128-key tiles): every key a real row sees lies in a visited tile, and in a
  visited tile a key is masked (need_mask and outside Window::keys, or Window::hides) exactly when the row does not
  see it;
* dK/dV CTAs (64 keys; 64-row query tiles): every row that sees a key of the block lies in a visited tile, and the
  tile's mask (Window::crosses, the tail, padding rows) hides exactly the pairs that are not visible;
* with Window{-1, 0} and Window{-1, -1} the ranges are those of the causal and full helpers the NVFP4 and QAT
  kernels keep using (key_tiles, query_tiles with a bool).
"""
import shutil
import subprocess

import pytest

from sagecupy import _loader

HEADER = r"""
#include <algorithm>
#include <cstdio>
using std::min;
using std::max;
#define __device__
#define __forceinline__ inline
struct int2 { int x, y; };
inline int2 make_int2(int a, int b) { return {a, b}; }
"""

CHECK = r"""
static bool seen(int i, int j, int nq, int nk, int left, int right) {  // the definition, with the caller's window
  const int s = nk - nq;
  return j >= 0 && j < nk && i >= 0 && i < nq && (right < 0 || j <= i + s + right) && (left < 0 || j >= i + s - left);
}
static int bad = 0;
#define FAIL(...) do { if (bad++ < 10) printf(__VA_ARGS__); } while (0)
template <int TILE>
void rows_side(int nq, int nk, int l0, int r0, Window w) {
  const int shift = nk - nq, nq_pad = (nq + 127) / 128 * 128, bq = 64;
  for (int q0 = 0; q0 < nq_pad; q0 += bq) {
    const KeyRange t = key_range<TILE>(q0, bq, nq, nk, w);
    if (w.left == -1 && (w.right == 0 || w.right == -1)) {
      const KeyTiles o = key_tiles<TILE>(q0, bq, nq, nk, w.right == 0);
      if (o.n != t.n || t.first != 0 || t.masked_below != 0 || (t.n > 0 && o.first_masked != t.first_masked))
        FAIL("key_range != key_tiles nq=%d nk=%d q0=%d\n", nq, nk, q0);
    }
    for (int i = q0; i < q0 + bq && i < nq; ++i) {
      const int2 rk = w.keys(i, shift, nk);
      for (int j = 0; j < (nk + TILE - 1) / TILE * TILE; ++j) {
        const int tile = j / TILE;
        const bool v = seen(i, j, nq, nk, l0, r0), in = tile >= t.first && tile < t.n;
        if (v && !in) FAIL("key tile skipped: nq=%d nk=%d w=(%d,%d) i=%d j=%d\n", nq, nk, l0, r0, i, j);
        if (!in) continue;
        const bool fwd = !(t.need_mask(tile) && (j < rk.x || j > rk.y));
        const bool dq = !(t.need_mask(tile) && (j >= nk || w.hides(i, j, shift)));
        if (fwd != v || dq != v) FAIL("key mask: nq=%d nk=%d w=(%d,%d) i=%d j=%d\n", nq, nk, l0, r0, i, j);
      }
    }
  }
}
void keys_side(int nq, int nk, int l0, int r0, Window w) {
  const int shift = nk - nq, bk = 64, bq = 64;
  for (int k0 = 0; k0 < nk; k0 += bk) {
    const QueryTiles t = query_tiles(k0, bk, bq, nq, nk, w, 1);
    if (w.left == -1 && (w.right == 0 || w.right == -1)) {
      const QueryTiles o = query_tiles(k0, bq, nq, nk, w.right == 0, 1);
      if (o.first != t.first || o.n != t.n || o.per_head != t.per_head)
        FAIL("query_tiles differ from the bool ones nq=%d nk=%d k0=%d\n", nq, nk, k0);
    }
    for (int j = k0; j < k0 + bk && j < nk; ++j)
      for (int i = 0; i < (nq + bq - 1) / bq * bq; ++i) {
        const int qt = i / bq, q0 = qt * bq;
        const bool v = seen(i, j, nq, nk, l0, r0), in = qt >= t.first && qt < t.first + t.per_head;
        if (v && !in) FAIL("query tile skipped: nq=%d nk=%d w=(%d,%d) i=%d j=%d\n", nq, nk, l0, r0, i, j);
        if (!in) continue;
        const bool need = w.crosses(q0, bq, k0, bk, shift) || k0 + bk > nk || q0 + bq > nq;
        if (!(need && (j >= nk || i >= nq || w.hides(i, j, shift))) != v)
          FAIL("query mask: nq=%d nk=%d w=(%d,%d) i=%d j=%d\n", nq, nk, l0, r0, i, j);
      }
  }
}
int main() {
  int nq, nk, l0, r0, l, r, cases = 0;
  while (scanf("%d %d %d %d %d %d", &nq, &nk, &l0, &r0, &l, &r) == 6) {
    const Window w{l, r};
    rows_side<64>(nq, nk, l0, r0, w);
    rows_side<128>(nq, nk, l0, r0, w);
    keys_side(nq, nk, l0, r0, w);
    ++cases;
  }
  printf("cases %d bad %d\n", cases, bad);
  return bad != 0;
}
"""


def _helpers():
    """rows.cuh from KEY_TILE (the tile helpers) to the accumulator store (which needs CUDA types)."""
    src = (_loader.kernel_dir() / "common" / "rows.cuh").read_text()
    return src[src.index("constexpr int KEY_TILE"):src.index("// dst[row, col]")]


def test_window_tile_ranges_and_masks(tmp_path):
    from sagecupy import _checks, int8

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    (tmp_path / "check.cpp").write_text(HEADER + _helpers() + CHECK)
    exe = tmp_path / "check"
    subprocess.run([cxx, "-std=c++17", "-O2", "-o", str(exe), str(tmp_path / "check.cpp")], check=True)
    lens = (1, 2, 17, 63, 64, 65, 127, 128, 129, 200, 333)
    sides = (-1, 0, 1, 5, 17, 63, 64, 127, 128, 300)
    lines = []
    for nq in lens:
        for nk in lens:
            for left in sides:
                for right in sides:
                    p = _checks.Problem(1, 1, 1, nq, nk, 64, "float16", "HND", False, 0.125, (left, right))
                    lines.append(f"{nq} {nk} {left} {right} {' '.join(map(str, int8.kernel_window(p)))}")
    r = subprocess.run([str(exe)], input="\n".join(lines), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"cases {len(lines)} bad 0"
