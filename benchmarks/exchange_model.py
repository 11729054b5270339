"""Alpha-beta model of SyncBatchNorm's forward statistics exchange: gather vs reduce, ring vs tree.

Prints markdown tables (the ones in ``docs/scaling.md``): the time and the bytes each rank
receives per layer and per ResNet-50 training step, for sync groups of P = 8 ... 4096 ranks.

Payloads (see :mod:`syncbn_lightning.functional.reduce`):
    gather: every rank contributes one float32 row of ``2C + 4`` values, so it receives
        ``m_g = 4 (2C + 4) P`` bytes;
    reduce: one float64 vector of ``2C + 15`` values, ``m_r = 8 (2C + 15)`` bytes, any P.
"ring gather / tree reduce" compares the algorithms NCCL uses for small messages with several GPUs
per node; "best / best" the fastest of each (a log-latency all-gather, e.g. NCCL's PAT, where one
is available). Costs, with alpha the per-message latency and beta the inverse bandwidth
(seconds per byte):
    all-gather, ring:                 (P - 1) alpha + (P - 1)/P * m_g beta
    all-gather, log (Bruck / PAT):    ceil(log2 P) alpha + (P - 1)/P * m_g beta
    all-reduce, ring:                 2 (P - 1) alpha + 2 (P - 1)/P * m_r beta
    all-reduce, tree (double binary): 2 ceil(log2 P) alpha + 2 m_r beta
The backward's all-reduce of ``2C`` float32 sums is the same for both exchanges and not counted.
A model, not a measurement: NCCL picks its algorithm per size, adds protocol overheads, and
hierarchical (intra-node NVLink, inter-node network) groups have two alpha/beta pairs; use
``--alpha-us`` and ``--beta-gbps`` for your fabric. Run: ``python benchmarks/exchange_model.py``.
"""

from __future__ import annotations

import argparse
import math

# ResNet-50's 53 BatchNorm layers by channel count: the stem, then per stage (blocks x [C, C, 4C]
# plus the downsample's 4C).
RESNET50_CHANNELS = (
    [64]
    + [c for _ in range(3) for c in (64, 64, 256)]
    + [256]
    + [c for _ in range(4) for c in (128, 128, 512)]
    + [512]
    + [c for _ in range(6) for c in (256, 256, 1024)]
    + [1024]
    + [c for _ in range(3) for c in (512, 512, 2048)]
    + [2048]
)
GROUP_SIZES = [2**k for k in range(3, 13)]  # 8 ... 4096


def gather_bytes(channels: int, ranks: int) -> int:
    """Bytes one rank receives from the gather exchange of a layer with ``channels``."""
    return 4 * (2 * channels + 4) * ranks


def reduce_bytes(channels: int) -> int:
    """Bytes of the reduce exchange's all-reduce for a layer with ``channels`` (any group)."""
    return 8 * (2 * channels + 15)


def times(channels: int, ranks: int, alpha: float, beta: float) -> dict[str, float]:
    """Seconds of one layer's forward exchange per algorithm (see the module docstring)."""
    logp = math.ceil(math.log2(ranks))
    shard = (ranks - 1) / ranks
    m_g, m_r = gather_bytes(channels, ranks), reduce_bytes(channels)
    return {
        "gather ring": (ranks - 1) * alpha + shard * m_g * beta,
        "gather log": logp * alpha + shard * m_g * beta,
        "reduce ring": 2 * (ranks - 1) * alpha + 2 * shard * m_r * beta,
        "reduce tree": 2 * logp * alpha + 2 * m_r * beta,
    }


def _bytes_text(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _time_text(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def table(layers: list[int], alpha: float, beta: float, title: str) -> str:
    """A markdown table of the exchange of ``layers`` (channel counts) for every group size."""
    names = ["gather ring", "gather log", "reduce ring", "reduce tree"]
    head = ["P", "gather recv", "reduce recv", *names, "ring gather / tree reduce", "best / best"]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ranks in GROUP_SIZES:
        total = dict.fromkeys(names, 0.0)
        for channels in layers:
            for name, seconds in times(channels, ranks, alpha, beta).items():
                total[name] += seconds
        best_gather = min(total["gather ring"], total["gather log"])
        best_reduce = min(total["reduce ring"], total["reduce tree"])
        row = [
            str(ranks),
            _bytes_text(sum(gather_bytes(c, ranks) for c in layers)),
            _bytes_text(sum(reduce_bytes(c) for c in layers)),
            *(_time_text(total[name]) for name in names),
            f"{total['gather ring'] / total['reduce tree']:.2f}x",
            f"{best_gather / best_reduce:.2f}x",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpha-us", type=float, default=5.0, help="latency per message, us")
    parser.add_argument("--beta-gbps", type=float, default=25.0, help="bandwidth, GB/s per rank")
    parser.add_argument("--channels", type=int, default=256, help="channels of the single layer")
    args = parser.parse_args()
    alpha, beta = args.alpha_us * 1e-6, 1.0 / (args.beta_gbps * 1e9)
    print(f"alpha = {args.alpha_us} us, beta = 1 / ({args.beta_gbps} GB/s)\n")
    print(table([args.channels], alpha, beta, f"One layer, C = {args.channels}"))
    print()
    title = (
        f"ResNet-50 forward, {len(RESNET50_CHANNELS)} BN layers, "
        f"sum(C) = {sum(RESNET50_CHANNELS)}: per training step"
    )
    print(table(RESNET50_CHANNELS, alpha, beta, title))


if __name__ == "__main__":
    main()
