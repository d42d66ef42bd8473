"""Replay a measured `ActivationProfile` under checkpointing and the activation CPU offload.

The profile is one forward's saved storages with their offload group. Checkpointing and the
offload only decide *which* of those stay on the device and when, by rules simple enough to
replay exactly:

- Checkpointing (accelerate's `fsdp2_apply_ac`, transformers' gradient checkpointing) keeps a
  layer's inputs instead of what the layer saves inside; backward recomputes one layer at a time,
  so that layer's inside saves come back, one layer at a time. A KV cache (a forward with
  use_cache) stays whole: each checkpointed layer's frame holds it until backward.
- The offload (`offload/handlers.py`) keeps on the device: non-float storages, storages under
  `min_tensor_bytes`, everything of the last group (unless `offload_last_group`) and after it, and
  whatever does not fit under `max_pinned_bytes`. Backward reloads a group plus `prefetch_groups`
  ahead (async; the sync handler reloads on demand, one group at a time).

What is replayed is the device-resident activation bytes at the head's backward (every save kept,
plus the logits' gradients) and at each group of backward (its saves and the gradients of its
intermediates that its backward holds beside them), both measured by the probe's meta backward,
or, for a checkpointed group, its recompute's worst moment where that is more (its saves and its
forward's temporaries, measured by the probe's forward: DoRA's norm); and at each group's forward
(the saves kept from the groups before it, the previous group's copies still in flight, its
inputs, and the most its own forward holds at once): DoRA's weight-sized temporaries make that
the peak of a short sequence. The peak is the largest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

from fsdp_offload_cfg.estimate.probe import ActivationProfile, SavedStorage
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.offload.pool import round_size


@dataclass(frozen=True)
class Residency:
    """Activation bytes under one setting."""

    saved_bytes: int  # saved for backward at the end of forward, wherever they sit
    forward_end_device_bytes: int  # on the device when forward ends (all kept saves still alive)
    device_peak_bytes: int  # on the device, at the worst moment of forward end or backward
    host_bytes: int  # offloaded to the host pool (pool bytes, rounded as the pool rounds)
    # every moment of backward, (activation bytes on the device, groups finished by then, whose
    # gradients exist), the head's backward first (every save kept so far, plus the logits'
    # gradients): the step's worst moment adds the finished groups' gradients to each, so it can
    # be a later moment than the activations' own peak (`report.device_at_peak`)
    moments: tuple[tuple[int, int], ...]
    # each group's worst moment in forward, in forward order (0 for a recomputed group: its
    # recompute in backward holds that and its kept input more); no gradient exists then, unless
    # accumulating
    forward_moments: tuple[int, ...] = ()
    # of the kept saves, those the offload would have moved but for `max_pinned_bytes`
    capped_bytes: int = 0


def checkpointed_storages(profile: ActivationProfile, checkpointed: Collection[int] | None = None) -> list[SavedStorage]:
    """What a forward keeps with the groups in `checkpointed` (default: all) checkpointed: every
    save outside the groups and inside the others, plus each checkpointed group's inputs (in the
    group whose checkpoint first takes them, as the offload would number them), plus what the
    output keeps alive (the KV cache: kept on the device, after the last group)."""
    chosen = set(range(len(profile.groups)) if checkpointed is None else checkpointed)
    out = {s.key: s for s in profile.saved if not (s.inside and s.group in chosen)}
    for key, s in profile.inputs.items():  # recorded at group entry, hence marked inside
        if s.group in chosen:
            out.setdefault(key, dataclasses.replace(s, inside=False))
    if chosen:
        for key, s in profile.held.items():  # recorded after the last group: nothing offloads them
            out.setdefault(key, s)
    return list(out.values())


def residency(storages: list[SavedStorage], n_groups: int, offload: ActivationOffloadConfig | None,
              async_reload: bool, recompute: list[int] | None = None,
              offloaded_groups: Collection[int] | None = None, backward_extra: list[int] | None = None,
              head_extra: int = 0, recompute_peak: list[int] | None = None,
              forward_peak: list[int] | None = None, entry: list[dict[int, int]] | None = None) -> Residency:
    """Replay the offload's keep/offload decisions and backward's walk over the groups (the
    offload on `offloaded_groups`; default: every group it offloads when on for the whole model),
    from the head's backward (`head_extra` beyond every save) down, each group's backward holding
    `backward_extra` more than its saves (`probe`), and a checkpointed group's recompute
    `recompute_peak` at its worst moment (its saves and its forward's temporaries), if more; and
    each group's forward, holding `forward_peak` beside its `entry` storages (its inputs)."""
    kept = [0] * (n_groups + 1)
    offloaded = [0] * (n_groups + 1)
    on_device: list[set[int]] = [set() for _ in range(n_groups + 1)]  # keys of the kept saves, by group
    pool = capped = 0
    if offloaded_groups is None:
        offloaded_groups = () if offload is None else range(n_groups if offload.offload_last_group else n_groups - 1)
    on = set(offloaded_groups)
    for s in storages:
        size = round_size(s.nbytes)
        offloadable = (offload is not None and s.floating and s.nbytes >= offload.min_tensor_bytes
                       and s.group in on)
        if offloadable and (offload.max_pinned_bytes is None or pool + size <= offload.max_pinned_bytes):
            pool += size
            offloaded[s.group] += s.nbytes
        else:
            kept[s.group] += s.nbytes
            on_device[s.group].add(s.key)
            capped += s.nbytes if offloadable else 0
    window = 1 + (offload.prefetch_groups if offload is not None and async_reload else 0)
    recompute = recompute or [0] * n_groups
    forward = _forward_moments(kept, offloaded, on_device, recompute, forward_peak, entry,
                               in_flight=offload is not None and async_reload)
    extra = backward_extra or [0] * n_groups
    recompute_peak = recompute_peak or [0] * n_groups
    # the head's backward first: everything kept is still there, beside the logits' gradients
    moments = [(sum(kept) + head_extra, 0)]
    for i in range(n_groups - 1, -1, -1):  # backward at group i: later groups' saves are freed
        reloaded = sum(offloaded[max(0, i - window + 1): i + 1])
        moments.append((sum(kept[: i + 1]) + reloaded + max(recompute[i] + extra[i], recompute_peak[i]),
                        n_groups - 1 - i))
    peak = max([now for now, _ in moments] + forward)
    return Residency(sum(kept) + sum(offloaded), sum(kept), peak, pool, tuple(moments), tuple(forward), capped)


def _forward_moments(kept: list[int], offloaded: list[int], on_device: list[set[int]], recompute: list[int],
                     forward_peak: list[int] | None, entry: list[dict[int, int]] | None, in_flight: bool) -> list[int]:
    """Each group's worst moment in forward: the saves kept from the groups before it, the
    previous group's offloaded saves while their copies run (the async handler drops them when
    this group ends: `offload/handlers.py`), its inputs where no earlier save already counts
    them, and the most its forward holds at once. A recomputed group's is left out (0): its
    recompute in backward holds as much, and its input kept besides."""
    n_groups = len(recompute)
    if not forward_peak:
        return [0] * n_groups
    entry = entry or [{} for _ in range(n_groups)]
    moments, counted = [], set()
    for i in range(n_groups):
        inputs = sum(n for key, n in entry[i].items() if key not in counted)
        copying = offloaded[i - 1] if in_flight and i else 0
        moments.append(0 if recompute[i] else sum(kept[:i]) + copying + inputs + forward_peak[i])
        counted |= on_device[i]
    return moments


def replay(profile: ActivationProfile, storages: list[SavedStorage], offload: ActivationOffloadConfig | None,
           async_reload: bool, recompute: list[int] | None = None,
           offloaded_groups: Collection[int] | None = None) -> Residency:
    """`residency` of `storages` (the profile's saves, or what checkpointing leaves of them) with
    the profile's own backward figures, and its forward's for the recomputed groups: each setting
    and each plan reads them from here alone."""
    peaks = profile.forward_peak or [0] * len(profile.groups)
    flowing = profile.backward_entry or [0] * len(profile.groups)
    recompute_peak = [peak + grads if done else 0
                      for peak, grads, done in zip(peaks, flowing, recompute or [0] * len(profile.groups))]
    return residency(storages, len(profile.groups), offload, async_reload, recompute, offloaded_groups,
                     profile.backward_extra, profile.head_backward_bytes(), recompute_peak,
                     profile.forward_peak, profile.entry)


def settings(profile: ActivationProfile, offload: ActivationOffloadConfig, async_reload: bool) -> dict[str, Residency]:
    """Residency under the four combinations of checkpointing and offload."""
    plain = profile.saved
    ckpt = checkpointed_storages(profile)
    recompute = profile.inside_bytes_per_group()
    enabled = dataclasses.replace(offload, enabled=True)  # the config's knobs, even where it leaves it off
    return {
        "plain": replay(profile, plain, None, async_reload),
        "checkpointing": replay(profile, ckpt, None, async_reload, recompute),
        "offload": replay(profile, plain, enabled, async_reload),
        "checkpointing_and_offload": replay(profile, ckpt, enabled, async_reload, recompute),
    }
