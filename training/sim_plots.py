"""Plots of a simulator run: latency CDF per policy, and mean / p99 latency against arrival rate."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdf(e2e_by_policy: Mapping[str, Sequence[float]], load: float, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values in e2e_by_policy.items():
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (s, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"Latency CDF at load {load:g}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency_vs_rate(sweep: Sequence[dict], path: Path) -> None:
    """`sweep`: entries {arrival_rate_per_s, load, policies: {name: {mean_e2e_s, p99_e2e_s}}}."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    names = list(sweep[0]["policies"]) if sweep else []
    rates = [entry["arrival_rate_per_s"] for entry in sweep]
    for ax, metric, title in ((axes[0], "mean_e2e_s", "mean"), (axes[1], "p99_e2e_s", "p99")):
        for name in names:
            ax.plot(rates, [entry["policies"][name][metric] for entry in sweep], marker="o", label=name)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(f"{title} end-to-end latency (s)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    loads = ", ".join(f"{entry['load']:g}" for entry in sweep)
    fig.suptitle(f"Latency against arrival rate (loads {loads})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
