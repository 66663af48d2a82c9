"""How long the NVFP4 warp-specialized forward's grid takes in units of one full CTA (192 query rows, every key tile),
if CTAs are dispatched in grid order to whichever SM frees first (one CTA per SM: its shared memory): the tail
effect of the last wave, and what SAGE_FP4_WS_IDLE_SKIP (the last query block's padding warpgroups idle) can gain.
No GPU; the per-CTA costs are models, stated below. Run:

    python bench/tools/cta_schedule_sim.py [--sms 132] [--heads 16] [--shapes 4:4096,1:16384,16:4096]

Models: a CTA's cost is proportional to the key tiles it reads (non-causal: all; causal: up to its last row's
diagonal), times 1 with three busy consumer warpgroups; a last query block of 64 real rows costs `s` of that with the
skip (two idle warpgroups; s between 1/3, perfectly efficient, and 1, no gain: printed for s = 0.45 and 0.6) and 1
without. Causal grids are taken heaviest first (the kernel's order, common/rows.cuh query_block), non-causal ones
in head order. Printed: the work per SM (the bound a perfect split would reach) and the makespan.
"""
import argparse
import heapq


def makespan(costs, sms):
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def grid_costs(batch, heads, n, causal, s_last, rows=192):
    blocks = -(-n // rows)
    partial = n % rows != 0
    costs = []
    for i in range(blocks):
        c = min(rows * (i + 1), n) / n if causal else 1.0
        if partial and i == blocks - 1 and s_last is not None:
            c *= s_last
        costs.append(c)
    grid = costs * (batch * heads)
    return sorted(grid, reverse=True) if causal else grid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--shapes", default="4:4096,1:16384,16:4096")
    a = ap.parse_args()
    for shape in a.shapes.split(","):
        batch, n = (int(x) for x in shape.split(":"))
        for causal in (False, True):
            parts = []
            for label, s in (("no skip", None), ("skip s=0.45", 0.45), ("skip s=0.6", 0.6)):
                g = grid_costs(batch, a.heads, n, causal, s)
                parts.append(f"{label}: work/SM {sum(g) / a.sms:.2f}, makespan {makespan(g, a.sms):.2f}")
            print(f"B={batch} N={n} causal={causal!s:<5} " + " | ".join(parts))


if __name__ == "__main__":
    main()
