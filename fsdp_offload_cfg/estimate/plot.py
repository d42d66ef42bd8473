"""`fsdp-offload-cfg estimate --plot memory.png`: one stacked bar per activation setting.

Each bar is the report's `device_by_setting` entry, rank 0's device memory at the step's worst
moment split by kind, so a user sees at a glance which setting fits, and what to cut when none
does: the states shard with more ranks, activations shrink with checkpointing or offload. A
horizontal line marks the device's capacity when it is known (`--device-memory`, else the visible
GPU's). With `--activation-budget`, the plan is one more bar, a dotted line on it where the budget
lets its activations reach. The bars are drawn from the report alone, so the picture never says more than the numbers.

matplotlib is an optional extra (`pip install 'fsdp-offload-cfg[plot]'`): it is imported only
here, and checked before the estimate runs so that a missing one costs no minutes.
"""

from __future__ import annotations

from typing import Any

from fsdp_offload_cfg.estimate.inputs import EstimateError

# (key in device_by_setting, legend label, colour): bottom to top, what sharding cuts first
KINDS = (
    ("params_bytes", "parameters", "#4c72b0"),
    ("grads_bytes", "gradients", "#55a868"),
    ("optimizer_bytes", "optimizer state", "#8172b2"),
    ("buffers_and_gathered_bytes", "buffers + gathered parameters", "#937860"),
    ("activations_bytes", "activations", "#dd8452"),
    ("logits_grad_bytes", "logits' gradient", "#c44e52"),
    ("optimizer_step_bytes", "optimizer step's temporary", "#8c8c8c"),
)
GIB = 2**30


def require_matplotlib() -> None:
    """Raise the install hint now, before minutes of estimate, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise EstimateError("--plot needs matplotlib, an optional extra: pip install 'fsdp-offload-cfg[plot]' "
                            "(or drop --plot)") from error


def draw_memory(report: dict[str, Any], capacity_bytes: int | None = None) -> Any:
    """The figure (a matplotlib `Figure`): one bar per setting, the config's own marked."""
    require_matplotlib()
    from matplotlib.figure import Figure  # not pyplot: no backend chosen, no window, no global state

    settings = report["device_by_setting"]
    names = list(settings)
    chosen = report["inputs"]["activation_setting"]
    figure = Figure(figsize=(1.8 * len(names) + 3.5, 4.8), layout="constrained")
    axes = figure.add_subplot()
    bottoms = [0.0] * len(names)
    for key, label, colour in drawn_kinds(report):
        heights = [settings[n][key] / GIB for n in names]
        axes.bar(names, heights, bottom=bottoms, label=label, color=colour, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, top in enumerate(bottoms):
        axes.annotate(f"{top:.1f}", (i, top), ha="center", va="bottom", fontsize=9)
    if "plan" in report:
        _mark_budget(axes, names.index("plan"), settings["plan"], report["plan"]["budget_bytes"])
    if capacity_bytes:
        axes.axhline(capacity_bytes / GIB, color="black", linestyle="--", linewidth=1,
                     label=f"device memory ({capacity_bytes / GIB:.0f} GiB)")
    axes.set_xticks(range(len(names)),
                    [n.replace("_", " ") + (" *" if n == chosen else "") for n in names], fontsize=9)
    axes.set_ylabel("GiB per rank at the step's peak")
    inputs = report["inputs"]
    axes.set_title(f"{report['model']['class']}, {report['ranks']} ranks, batch {inputs['batch_size']} x "
                   f"{inputs['seq_len']} tokens, {inputs['compute_dtype']} (* this config)", fontsize=10)
    axes.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return figure


def drawn_kinds(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The kinds of memory some setting holds: a kind that is zero in every bar would only add a
    legend entry for nothing."""
    settings = report["device_by_setting"].values()
    return [kind for kind in KINDS if any(setting[kind[0]] for setting in settings)]


def _mark_budget(axes: Any, x: int, plan: dict[str, int], budget_bytes: int) -> None:
    """A dotted line over the plan's bar where its activations may reach: the budget on top of
    everything else the plan's bar holds below its activations."""
    below = sum(plan[key] for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_and_gathered_bytes"))
    axes.hlines((below + budget_bytes) / GIB, x - 0.4, x + 0.4, colors="black", linestyles=":",
                label=f"activation budget ({budget_bytes / GIB:.1f} GiB)")


def save_memory_plot(report: dict[str, Any], path: str, capacity_bytes: int | None = None) -> None:
    try:
        draw_memory(report, capacity_bytes).savefig(path, dpi=120)
    except OSError as error:
        raise EstimateError(f"--plot: cannot write {path}: {error.strerror or error}") from error


def parse_size(text: str, option: str = "--device-memory") -> int:
    """A size option: bytes as an integer, or with a unit (80GiB, 80GB, 81920MiB)."""
    from fsdp_offload_cfg._sizes import size_in_bytes

    value = size_in_bytes(text)
    if value is None:
        raise EstimateError(f"{option}: expected a size from 1 byte to 1 PiB, such as 80GiB, got {text!r}")
    return value


