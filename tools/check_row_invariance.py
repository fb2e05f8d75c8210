"""Which bf16 ops give a row the same bits whatever rows share its call (tree vs decode)?

    python -m tools.check_row_invariance [--threads 2] [--pad 0]

For each projection shape (the demo target's and a 7B's) it runs M rows through ``F.linear``
in one call and each row alone, and prints how many of the M rows differ. ``--pad P`` runs
every call with fewer than P rows padded to P rows (the "same kernel for decode and
verification" fix), to show whether a fixed call shape restores invariance. Then the same
for attention: a masked batched call over a tree vs each row's own one-row call.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from tools.options import positive_int
from tools.tables import markdown_header, markdown_row

SHAPES = [(768, 256), (256, 768), (8192, 256), (4096, 1024), (1024, 4096), (11008, 4096), (4096, 11008)]
ROWS = [2, 7, 16, 33, 64, 300]


def linear(x: torch.Tensor, weight: torch.Tensor, pad: int) -> torch.Tensor:
    rows = x.shape[0]
    if rows < pad:
        x = torch.cat([x, x.new_zeros(pad - rows, x.shape[1])])
    return F.linear(x, weight)[:rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--pad", type=int, default=0, help="pad calls of fewer rows to this many (0: no padding)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"command: python -m tools.check_row_invariance {' '.join(sys.argv[1:])}  (torch {torch.__version__})")
    print(markdown_header(["op", "shape (out x in)", *(f"M={m}" for m in ROWS)]))
    for out_features, in_features in SHAPES:
        weight = (torch.randn(out_features, in_features) * in_features ** -0.5).bfloat16()
        x = torch.randn(max(ROWS), in_features).bfloat16()
        singles = torch.cat([linear(x[row:row + 1], weight, args.pad) for row in range(max(ROWS))])
        differing = [int((linear(x[:m], weight, args.pad) != singles[:m]).any(-1).sum()) for m in ROWS]
        print(markdown_row(["bf16 linear", f"{out_features}x{in_features}",
                            *(f"{d}/{m}" for d, m in zip(differing, ROWS))]))
    for heads, prefix in ((4, 40), (32, 1000)):
        q = torch.randn(1, heads, 64, 128).bfloat16()
        keys = torch.randn(1, heads, prefix + 64, 128).bfloat16()
        values = torch.randn(1, heads, prefix + 64, 128).bfloat16()
        cells = []
        for m in ROWS:
            if m > 64:
                cells.append("-")
                continue
            # A chain: row i attends to the prefix and rows 0..i (a decode of row i sees the same).
            mask = torch.ones(m, prefix + m, dtype=torch.bool).tril(diagonal=prefix)
            batched = F.scaled_dot_product_attention(q[:, :, :m], keys[:, :, :prefix + m], values[:, :, :prefix + m],
                                                     attn_mask=mask)
            single = torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1], keys[:, :, :prefix + i + 1],
                                                               values[:, :, :prefix + i + 1]) for i in range(m)], 2)
            cells.append(f"{int((batched != single).any(-1).any(1).sum())}/{m}")
        print(markdown_row(["bf16 attention, masked batch vs one row", f"{heads} heads, prefix {prefix}", *cells]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
