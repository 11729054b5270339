"""Host cost of how the C++ path's settings cross from Python: by keyword or in schema order.

    python benchmarks/bench_op_args.py [--rounds 15] [--calls 2000]

Calls ``torch.ops.syncbn.sync_batch_norm.default`` on a 2x4x3 float32 tensor (no group, no
autograd) with the layer's settings passed by keyword, and with the same values in the order the
schema declares them (what ``functional/layer_call.py`` does), interleaved round by round;
prints the median µs per call of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from syncbn_lightning.functional.layer_call import settings_in_schema_order
from syncbn_lightning.ops.build import load_extension


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    load_extension()
    op = torch.ops.syncbn.sync_batch_norm.default
    x, weight, bias = torch.randn(2, 4, 3), torch.ones(4), torch.zeros(4)
    running = (torch.zeros(4), torch.ones(4))
    counters = [torch.zeros(1, dtype=torch.long) for _ in range(3)]
    settings = {
        "group": None, "world_size": 1, "layer_tag": 7, "reduce": False, "momentum": 0.1,
        "eps": 1e-5, "unbiased": True, "equal_rank_weights": False, "queue_order_flags": False,
        "num_features": 4,
    }  # fmt: skip
    ordered = settings_in_schema_order(op, settings)
    head = (x, weight, bias, *running, *counters, None, 0, 0.0)

    def by_keyword() -> None:
        op(*head, **settings)

    def in_order() -> None:
        op(*head, *ordered)

    times: dict[str, list[float]] = {"by keyword": [], "in schema order": []}
    with torch.no_grad():
        variants = [("by keyword", by_keyword), ("in schema order", in_order)]
        for round_ in range(args.rounds):
            for name, call in variants if round_ % 2 else variants[::-1]:  # either goes first
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"torch {torch.__version__}, {args.rounds} rounds of {args.calls} calls\n")
    print("| settings passed | µs / call (median of rounds) |")
    print("|---|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
