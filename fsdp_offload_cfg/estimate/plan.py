"""Plan each layer's activations to a device-memory budget: keep, offload, checkpoint, or both.

`fsdp-offload-cfg estimate --activation-budget 12GiB` answers the question a user otherwise
answers by trial: checkpointing everything costs a recomputed forward per layer, offloading
everything costs copies that a short layer cannot hide, and the budget usually needs neither
for every layer. Per decoder layer (offload group) there are four choices:

| choice | on the device until backward | extra time |
|---|---|---|
| keep | what the layer saves | none |
| offload | what the offload leaves (small, non-float) | the copy time the layer's compute does not hide |
| checkpoint | the layer's inputs | one more forward of the layer |
| checkpoint_offload | nothing but small inputs | the recompute, plus the input's copy if not hidden |

The plan is greedy over each layer's choices that are worth taking (no other saves as many
bytes for less time), the way a knapsack's fractional relaxation is solved: copies that hide under the layer's own compute go
first (they cost nothing), then whichever move buys the most bytes per second of extra time,
until the replayed peak (`activations.residency`: the head's backward, where every kept save
meets the logits' gradients, and every layer's backward step, its working set, reload window
and recompute included) is within the budget. The four uniform settings are candidates
too, so a plan is never estimated slower than the best single setting that fits.

The time model is stated, not measured: a layer's forward takes its FLOPs at `compute_flops`
per second, its backward twice that; a copy moves `copy_bytes` per second each way and, with
the async offload, hides under the forward of its layer (out) and the backward (in). Prior art:
torchtitan's compile-time budgeted offload (PR #3521) plans on the traced graph; this plans on
the meta forward the estimate already records, per layer, as the offload and checkpointing act.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_offload_cfg._sizes import show_size
from fsdp_offload_cfg.estimate.activations import Residency, checkpointed_storages, replay
from fsdp_offload_cfg.estimate.inputs import EstimateError
from fsdp_offload_cfg.estimate.probe import ActivationProfile, SavedStorage
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig

CHOICES = ("keep", "offload", "checkpoint", "checkpoint_offload")
UNIFORM = {"plain": "keep", "checkpointing": "checkpoint", "offload": "offload",
           "checkpointing_and_offload": "checkpoint_offload"}


@dataclass(frozen=True)
class TimeModel:
    """What a layer's compute and a copy cost (assumed: see `default_time_model`)."""

    compute_flops: float  # FLOP/s a layer's matmuls and attention run at
    copy_bytes: float  # bytes/s of one device <-> host copy direction
    overlapped: bool  # copies run beside compute (the async offload on CUDA), else in line


def default_time_model(device: str, async_reload: bool, compute_flops: float | None = None,
                       copy_bytes: float | None = None) -> TimeModel:
    """The given rates, else assumed ones: on CUDA what an H100 ran at in this project's first GPU
    run (2026-11-25, an H100: a 0.85B Llama's bf16 step at 8192 tokens, ~350 TFLOP/s; pinned copies at 55 GB/s
    each way), copies beside compute under the async offload; on a CPU a few cores' GFLOP/s and a
    memcpy's bandwidth, copied in line."""
    default_flops, default_copy = (350e12, 55e9) if device == "cuda" else (50e9, 5e9)
    return TimeModel(compute_flops=compute_flops or default_flops, copy_bytes=copy_bytes or default_copy,
                     overlapped=device == "cuda" and async_reload)


@dataclass(frozen=True)
class LayerPlan:
    name: str
    choice: str
    device_bytes: int  # this layer's saves on the device at forward end under its choice
    host_bytes: int  # this layer's saves in the host pool
    extra_seconds: float  # what its choice adds to a step


@dataclass(frozen=True)
class Plan:
    budget_bytes: int | None  # None: a uniform setting, planned to no budget
    layers: list[LayerPlan]
    residency: Residency
    compute_seconds: float  # the layers' forward and backward with every layer kept
    extra_seconds: float
    time: TimeModel  # the rates it was planned at

    @property
    def choices(self) -> list[str]:
        return [layer.choice for layer in self.layers]


@dataclass(frozen=True)
class _Option:
    choice: str
    device_bytes: int
    host_bytes: int
    seconds: float


def layer_runs(choices: list[str]) -> list[tuple[int, int, str]]:
    """(first, last, choice) for each run of consecutive layers with one choice: how a plan is
    shown, in the estimate's table and in the run's log line."""
    runs: list[tuple[int, int, str]] = []
    for i, choice in enumerate(choices):
        if runs and runs[-1][2] == choice:
            runs[-1] = (runs[-1][0], i, choice)
        else:
            runs.append((i, i, choice))
    return runs


def plan_to_budget(profile: ActivationProfile, budget_bytes: int, offload: ActivationOffloadConfig,
                   async_reload: bool, time: TimeModel) -> Plan:
    """The plan of least estimated extra time whose activation peak on the device is within
    `budget_bytes`; an `EstimateError` naming the smallest budget any plan meets when none does."""
    offload = dataclasses.replace(offload, enabled=True)
    options = [_frontier(_options(profile, i, offload, time)) for i in range(len(profile.groups))]
    at = [0] * len(options)  # each layer's position on its frontier, 0 = keep
    smallest = None  # the lowest peak of any plan tried, for the error when none fits
    while True:
        greedy = [o[k].choice for o, k in zip(options, at)]
        peak = _replay(profile, greedy, offload, async_reload).device_peak_bytes
        smallest = peak if smallest is None else min(smallest, peak)
        if peak <= budget_bytes or (move := _cheapest_move(options, at)) is None:
            break
        at[move[0]] = move[1]
    # a layer's bytes at forward end do not order the backward peak exactly (recompute, reloads):
    # each single setting is a candidate too, so the plan is never worse than one of them
    candidates = [_plan(profile, c, budget_bytes, offload, async_reload, time)
                  for c in [greedy] + [[u] * len(options) for u in UNIFORM.values()]]
    fitting = [p for p in candidates if p.residency.device_peak_bytes <= budget_bytes]
    if not fitting:
        smallest = min([smallest] + [p.residency.device_peak_bytes for p in candidates])
        raise BudgetUnreachable(budget_bytes, smallest)
    return min(fitting, key=lambda p: p.extra_seconds)


class BudgetUnreachable(EstimateError):
    """No plan fits the budget. Carries the least activation peak a plan reaches, so that `auto`
    can say it against the device's room (`room.Room.unreachable`) rather than ask the user to
    raise a budget they never wrote."""

    def __init__(self, budget_bytes: int, smallest_bytes: int) -> None:
        super().__init__(_unreachable(budget_bytes, smallest_bytes))
        self.smallest_bytes = smallest_bytes


def uniform_plans(profile: ActivationProfile, offload: ActivationOffloadConfig, async_reload: bool,
                  time: TimeModel) -> dict[str, Plan]:
    """Each single setting as a plan (its peak and its estimated extra time), to compare with."""
    offload = dataclasses.replace(offload, enabled=True)
    return {name: _plan(profile, [choice] * len(profile.groups), None, offload, async_reload, time)
            for name, choice in UNIFORM.items()}


def _unreachable(budget_bytes: int, smallest: int) -> str:
    budget, needed = show_size(budget_bytes), show_size(smallest)
    if budget == needed:  # both round alike ("0.3 MiB ... is 0.3 MiB"): the bytes tell them apart
        budget, needed = f"{budget} ({budget_bytes} bytes)", f"{needed} ({smallest} bytes)"
    return (f"activation budget {budget}: no plan fits; the smallest activation peak on the device "
            f"a plan reaches is {needed}. Raise the budget to at least that, or shorten the "
            "sequences or the batch")


def _stored(profile: ActivationProfile, group: int, checkpointed: bool) -> list[SavedStorage]:
    storages = checkpointed_storages(profile, {group}) if checkpointed else profile.saved
    return [s for s in storages if s.group == group]


def _options(profile: ActivationProfile, group: int, offload: ActivationOffloadConfig,
             time: TimeModel) -> list[_Option]:
    """The group's four choices as (device bytes, host bytes, extra seconds); the last group may
    not offload unless `offload_last_group` (backward needs it first, so the offload keeps it)."""
    forward = profile.flops[group] / time.compute_flops
    last = group == len(profile.groups) - 1 and not offload.offload_last_group
    out = []
    for choice in CHOICES:
        if last and choice.endswith("offload"):
            continue
        checkpointed = choice.startswith("checkpoint")
        stored = _stored(profile, group, checkpointed)
        moved = sum(s.nbytes for s in stored if s.floating and s.nbytes >= offload.min_tensor_bytes) \
            if choice.endswith("offload") else 0
        total = sum(s.nbytes for s in stored)
        seconds = (forward if checkpointed else 0.0) + _exposed_copy(moved, forward, time)
        out.append(_Option(choice, total - moved, moved, seconds))
    return out


def _exposed_copy(nbytes: int, forward: float, time: TimeModel) -> float:
    """Copy time not hidden: out under the layer's forward, back in under its backward (2x)."""
    copy = nbytes / time.copy_bytes
    if not time.overlapped:
        return 2 * copy
    return max(0.0, copy - forward) + max(0.0, copy - 2 * forward)


def _frontier(options: list[_Option]) -> list[_Option]:
    """keep, then by extra time the choices that each save more bytes than every cheaper one
    (a choice that saves less for more time is never worth taking)."""
    frontier = [options[0]]
    for o in sorted(options[1:], key=lambda o: (o.seconds, o.device_bytes)):
        if o.device_bytes < frontier[-1].device_bytes:
            frontier.append(o)
    return frontier


def _cheapest_move(options: list[list[_Option]], at: list[int]) -> tuple[int, int] | None:
    """(layer, position) of the move that buys device bytes at the least time per byte (free
    moves first, the largest of them first)."""
    best: tuple[float, int, int, int] | None = None
    for layer, (frontier, k) in enumerate(zip(options, at)):
        for j in range(k + 1, len(frontier)):
            saved = frontier[k].device_bytes - frontier[j].device_bytes
            cost = frontier[j].seconds - frontier[k].seconds
            key = (cost / saved, -saved, layer, j)
            if best is None or key < best:
                best = key
    return None if best is None else (best[2], best[3])


def _replay(profile: ActivationProfile, choices: list[str], offload: ActivationOffloadConfig,
            async_reload: bool) -> Residency:
    checkpointed = {i for i, c in enumerate(choices) if c.startswith("checkpoint")}
    offloaded = {i for i, c in enumerate(choices) if c.endswith("offload")}
    inside = profile.inside_bytes_per_group()
    recompute = [inside[i] if i in checkpointed else 0 for i in range(len(choices))]
    return replay(profile, checkpointed_storages(profile, checkpointed), offload, async_reload, recompute, offloaded)


def _plan(profile: ActivationProfile, choices: list[str], budget_bytes: int | None, offload: ActivationOffloadConfig,
          async_reload: bool, time: TimeModel) -> Plan:
    layers = []
    for i, (name, choice) in enumerate(zip(profile.groups, choices)):
        by_choice = {o.choice: o for o in _options(profile, i, offload, time)}
        o = by_choice.get(choice, by_choice["keep" if choice == "offload" else "checkpoint"])  # last group kept
        layers.append(LayerPlan(name, o.choice, o.device_bytes, o.host_bytes, o.seconds))
    compute = 3 * sum(profile.flops) / time.compute_flops
    return Plan(budget_bytes, layers, _replay(profile, [lp.choice for lp in layers], offload, async_reload),
                compute, sum(lp.extra_seconds for lp in layers), time)
