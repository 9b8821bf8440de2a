"""The PNG plots of the benchmarks: one figure set-up and one way to finish and save it.

matplotlib is imported on first use with the Agg backend (no display needed)."""
from typing import TYPE_CHECKING, Any, Tuple

if TYPE_CHECKING:  # matplotlib itself is imported on first use
    from matplotlib.figure import Figure


def new_figure(width: float = 8, height: float = 5, ncols: int = 1) -> Tuple["Figure", Any]:
    """(figure, axes) of a new matplotlib figure, Agg backend; ``ncols`` > 1 gives an
    array of axes side by side (so the axes are typed Any: an Axes or an array of them)."""
    # matplotlib is optional (requirements.txt): only --plot needs it.
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional, as above # pylint: disable=import-outside-toplevel
    return plt.subplots(1, ncols, figsize=(width, height))


def write_figure(fig: "Figure", path: str, dpi: int = 120) -> str:
    """Lays out ``fig``, writes it to ``path`` and closes it; returns ``path``."""
    import matplotlib.pyplot as plt  # optional: only --plot needs it # pylint: disable=import-outside-toplevel
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def save_figure(fig, ax, path: str, title: str, xlabel: str, ylabel: str,
                log_x: bool = False) -> str:
    """Labels, grid and legend on ``ax``, then writes ``fig`` to ``path`` and closes it;
    returns ``path``."""
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return write_figure(fig, path)


def sweep_speeds(sweep: dict):
    """(speed keys sorted by value, their float values) of a ``{mbit: point}`` sweep."""
    speeds = sorted(sweep, key=float)
    return speeds, [float(m) for m in speeds]


def annotate_shares(ax, x, step_ms, shares) -> None:
    """Labels each point (x[i], step_ms[i]) with shares[i] as a percentage."""
    for xm, y, share in zip(x, step_ms, shares):
        ax.annotate(f"{share:.0%}", (xm, y), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=8)


def sweep_axes_labels() -> Tuple[str, str]:
    """(x label, y label) of the step-time-against-link-speed sweeps."""
    return "link speed per host, Mbit/s each direction", "step time, ms (median)"


def bar_chart(path: str, values: dict, title: str, ylabel: str) -> str:
    """PNG of one bar per ``{label: value}`` (in the given order); returns ``path``."""
    fig, ax = new_figure(max(6.0, 0.9 * len(values) + 2), 4.5)
    labels = list(values)
    bars = ax.bar(range(len(labels)), [values[k] for k in labels], color="tab:blue")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    for bar, label in zip(bars, labels):
        ax.annotate(f"{values[label]:.3g}", (bar.get_x() + bar.get_width() / 2,
                                             bar.get_height()),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    return save_figure(fig, ax, path, title, "", ylabel)
