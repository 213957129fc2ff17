"""``kvpool bench serve --plot``: TTFT p90 against the request rate, one line per configuration, one panel per
model profile. matplotlib is optional (``pip install kvpool[plot]``); it is imported only here."""

from __future__ import annotations

from typing import Any, TextIO

__all__ = ["write_plot"]


def write_plot(report: dict[str, Any], path: str, err: TextIO) -> bool:
    """Write the plot of ``report`` (bench_serve's JSON) to ``path``; False (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvpool bench serve: --plot needs matplotlib (pip install 'kvpool[plot]')", file=err)
        return False
    models = list(report["models"])
    base_rps = report["base_rate_rps"] or 1.0
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        rows = [r for r in report["rows"] if r["model"] == name]
        for config in dict.fromkeys(r["config"] for r in rows):
            mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["rate_scale"])
            ax.plot(
                [r["rate_scale"] * base_rps for r in mine], [r["ttft_p90_s"] for r in mine], marker="o", label=config
            )
        ax.axhline(report["models"][name]["slo_ttft_s"], color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("requests per second")
        ax.set_ylabel("TTFT p90 (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
