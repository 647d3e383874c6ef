"""A cache model of the flash-attention training backward's tile traffic under the dK/dV kernels' dispatch orders.

Not a measurement: what it predicts is for tests/device/fa_harness.py --backward --chunks to confirm on the GPU.
The dK/dV kernels that sum dQ (ggml-cuda/fattn-back.cu: fa_back_mma_dkdv, fa_back_mma_dkdv2, fa_back_wgmma_dkdv) run a
block per (query head, key block); under a causal mask a block starting at key block kb walks the query blocks
qb = kb .. n-1 (64 rows each), one step each, and every step reads that query tile's Q and dO (BF16) and adds to its
dQ (F32): 64 x D x 8 bytes. Here `slots` blocks run at once (2 an SM on an H100's 132 SMs at head size 128), each at
its own speed (1 +- `jitter`: blocks sharing an SM, clocks), a new one starting where one ends, in the order given:
  heads  the heads fastest (ggml-cuda's grid (heads, sequences, key blocks), GGML_CUDA_FA_BACK_KB_CHUNK unset)
  cN     chunks of N key blocks, the heads fastest across chunks and the key blocks within one (patch 0106)
  auto   chunks of max(8, key blocks / 8) (GGML_CUDA_FA_BACK_KB_CHUNK=auto)
  kb     every key block of a head before the next head (a chunk as long as the context)
and the tiles go through an LRU cache of `l2` MiB (an H100 has 50 MB of L2, in two halves: 40 is taken as usable).
A miss reads the tile and later writes its dQ back (1.5 x the tile's bytes). Printed: the share of the visits that
miss, the memory traffic in GB, and the makespan in steps of one block (the tail a dispatch order leaves), as a
Markdown table; --out writes the rows as JSON.

    python bench/fa_back_order_model.py [--orders heads,c8,c16,kb] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import OrderedDict

# (query heads, head size, tokens, sequences, key rows a block): the 1B shape (patch 0088's 128-key kernel at D = 64),
# the 8B and 70B shapes' heads at D = 128 (64-key blocks)
CASES = [
    (32, 64, 4096, 1, 128),
    (32, 64, 16384, 1, 128),
    (32, 128, 2048, 4, 64),
    (32, 128, 8192, 1, 64),
    (32, 128, 16384, 1, 64),
    (32, 128, 32768, 1, 64),
    (64, 128, 8192, 1, 64),
    (64, 128, 32768, 1, 64),
]


def dispatch_order(heads: int, seqs: int, nkb: int, order: str) -> list[tuple[int, int, int]]:
    """The (sequence, head, key block) of every block in the order they start."""
    if order == "heads":
        return [(s, h, kb) for kb in range(nkb) for s in range(seqs) for h in range(heads)]
    chunk = nkb if order == "kb" else max(8, nkb // 8) if order == "auto" else int(order[1:])
    return [
        (s, h, kb)
        for c0 in range(0, nkb, chunk)
        for s in range(seqs)
        for h in range(heads)
        for kb in range(c0, min(c0 + chunk, nkb))
    ]


def simulate(heads, d, tokens, seqs, kb_rows, order, slots=264, l2=40.0, jitter=0.1, seed=0) -> dict:
    rnd = random.Random(seed)
    nqb, nkb, r = tokens // 64, tokens // kb_rows, kb_rows // 64
    tile = 64 * d * 8
    cap = int(l2 * 2**20 // tile)
    blocks = dispatch_order(heads, seqs, nkb, order)
    cache: OrderedDict = OrderedDict()
    queue: list = []
    nxt = visits = misses = 0
    end = 0.0

    def start(t: float) -> None:
        nonlocal nxt
        if nxt < len(blocks):
            s, h, kb = blocks[nxt]
            nxt += 1
            speed = (1.0 + jitter * (2 * rnd.random() - 1)) * r  # a step of r query tiles' work per 64-row tile
            heapq.heappush(queue, (t, rnd.random(), s, h, kb * r, speed))

    for _ in range(slots):
        start(0.0)
    while queue:
        t, tie, s, h, qb, speed = heapq.heappop(queue)
        visits += 1
        if (s, h, qb) in cache:
            cache.move_to_end((s, h, qb))
        else:
            misses += 1
            cache[(s, h, qb)] = None
            if len(cache) > cap:
                cache.popitem(last=False)
        t += speed
        if qb + 1 < nqb:
            heapq.heappush(queue, (t, tie, s, h, qb + 1, speed))
        else:
            end = max(end, t)
            start(t)
    return {"visits": visits, "miss_rate": misses / visits, "gb": misses * tile * 1.5 / 1e9, "makespan": end}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--orders", default="heads,c8,c16,auto,kb")
    ap.add_argument("--slots", type=int, default=264, help="blocks running at once")
    ap.add_argument("--l2", type=float, default=40.0, help="MiB of L2 cache the tiles may use")
    ap.add_argument("--jitter", type=float, default=0.1, help="blocks' speeds spread +- this fraction")
    ap.add_argument("--out", help="JSON file for the rows")
    a = ap.parse_args()
    rows = []
    print("| heads x D | tokens x seqs | order | miss rate | GB | makespan (steps) |")
    print("|---|---|---|---|---|---|")
    for heads, d, tokens, seqs, kb_rows in CASES:
        for order in a.orders.split(","):
            res = simulate(heads, d, tokens, seqs, kb_rows, order, a.slots, a.l2, a.jitter)
            rows.append({"heads": heads, "D": d, "tokens": tokens, "seqs": seqs, "order": order, **res})
            print(
                f"| {heads} x {d} | {tokens} x {seqs} | {order} | {res['miss_rate']:.3f} | {res['gb']:.1f} | "
                f"{res['makespan']:.0f} |",
                flush=True,
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
