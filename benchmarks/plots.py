"""PNG plots of effective bandwidth vs size, one line per implementation (matplotlib, Agg backend)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterable

from .byte_counts import STEP_PASSES
from .common import Measurement

__all__ = ["plot_all"]

DTYPES = ("bfloat16", "float16", "float32")


def _fname(op: str, pas: str) -> str:
    return f"{op.replace('.', '_')}_{pas.replace('+', '_')}.png"


def plot_all(measurements: Iterable[Measurement], out_dir: str | Path, copy_gbps: float | None = None,
             gpu: str = "") -> list[Path]:
    """One PNG per (op, pass): a panel per dtype, x = last-dim size (params for optimizer ops, log scale),
    y = effective GB/s, one line per impl (``ok`` measurements only), the copy bandwidth as a dashed line.
    Returns the files written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    for m in measurements:
        if m.status == "ok" and m.gbps is not None:
            groups[(m.op, m.pas)].append(m)
    written = []
    for (op, pas), ms in sorted(groups.items()):
        dts = [d for d in DTYPES if any(m.dtype == d for m in ms)] + sorted(
            {m.dtype for m in ms} - set(DTYPES))
        fig, axes = plt.subplots(1, len(dts), figsize=(5.2 * len(dts), 4.2), squeeze=False)
        for ax, dt in zip(axes[0], dts):
            lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
            for m in ms:
                if m.dtype == dt:
                    lines[m.impl].append((m.cols, m.gbps))
            for impl, pts in sorted(lines.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            if copy_gbps:
                ax.axhline(copy_gbps, color="gray", linestyle="--", linewidth=1, label="D2D copy")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("parameters" if pas in STEP_PASSES else "last-dim size (cols)")
            ax.set_ylabel("effective bandwidth (GB/s)")
            ax.set_title(f"{op} {pas} {dt}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(gpu, fontsize=9)
        fig.tight_layout()
        path = out / _fname(op, pas)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
