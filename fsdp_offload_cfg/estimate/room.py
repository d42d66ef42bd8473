"""The device memory left for activations: what `activation_memory_budget: auto` plans to.

A budget is what the step can give activations at its worst moment, backward's (the estimate's
`device_at_peak`): the device's memory less what is there besides activations, less a margin.
At the first training forward part of that exists and part does not yet:

- **taken**, measured: the sharded parameters and buffers, the CUDA context and whatever else
  the process or the device already holds (the allocator, `mem_get_info`);
- **to come**, estimated from the model as the estimate counts it (`states.ShardedStates`):
  every gradient (they appear in backward, group by group; counting all of them holds under
  gradient accumulation too), AdamW's two moments (they appear at the first `step()`), and the
  gathered units (the tail and root for the whole step, a layer, its prefetched neighbour and
  one unit's gradients in backward); and the forward's output beside the loss (the logits),
  which a loop that keeps `outputs` through `backward(outputs.loss)` holds at backward's peak
  (accelerate's examples do; the Trainer does not). The estimate's peaks leave it out, as the
  Trainer runs; a budget that the device must hold whatever loop runs counts it (a 3B Llama at
  32k tokens on an H200 ran out of memory by its 7.8 GiB of bf16 logits, held twice by the
  benchmark's loop, before it did).

Offline (`fsdp-offload-cfg estimate --activation-budget auto --device-memory 80GiB`) nothing is
measured: taken is the estimate's parameters and buffers. Both ends take the same `to_come`, so
a CPU run against a stated device size plans what the estimate plans for the same numbers.

Prior art: torch's `activation_memory_budget` and torchtitan's `auto_perf_maxing` take a fraction
of the activations, not of the device; DeepCompile profiles a whole step first. Here the budget
comes before any step: the first forward is the one that has to fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_offload_cfg._sizes import AutoBudget, show_size
from fsdp_offload_cfg.estimate.inputs import EstimateError
from fsdp_offload_cfg.estimate.states import ShardedStates


@dataclass(frozen=True)
class Room:
    device_bytes: int  # what the plan may fill: the stated size, else the device's total
    taken_bytes: int  # there already (measured at run time; offline, the resident states)
    to_come_bytes: int  # gradients, optimizer state, gathered units, the output held: not allocated yet
    margin_bytes: int

    @property
    def budget_bytes(self) -> int:
        return self.device_bytes - self.taken_bytes - self.to_come_bytes - self.margin_bytes

    def describe(self) -> str:
        return (f"device {show_size(self.device_bytes)}, taken {show_size(self.taken_bytes)}, to come "
                f"{show_size(self.to_come_bytes)} (gradients, AdamW state, gathered layers, the output), margin "
                f"{show_size(self.margin_bytes)}")

    def unreachable(self, smallest_bytes: int) -> str:
        """`auto`'s words when no plan fits what the room leaves: the figures, how far short it
        is, and what changes them (the budget itself is not the user's number to raise)."""
        short = smallest_bytes - self.budget_bytes
        return (f"auto: {self.describe()}; that leaves {show_size(self.budget_bytes)} for activations, and the smallest "
                f"activation peak a plan reaches is {show_size(smallest_bytes)}, {show_size(short)} more; use more "
                "ranks (the states shard over them), offload_params, shorter sequences or a smaller batch, a smaller "
                "margin, or a larger device")

    def checked(self) -> Room:
        """Itself, if it leaves activations anything; else an `EstimateError` with the figures."""
        if self.budget_bytes <= 0:
            raise EstimateError(f"auto: nothing is left for activations ({self.describe()}); use more ranks (the "
                                "states shard over them), offload_params, a smaller margin, or a larger device")
        return self


def to_come(states: ShardedStates, resident: bool, output_bytes: int) -> int:
    """What backward's worst moment holds that the first forward has not allocated yet; with the
    parameters offloaded (`resident` false) their gradients and optimizer state live on the host.
    `output_bytes`: the forward's output a loop may hold through backward (`ActivationProfile`)."""
    return (states.grads + states.optimizer if resident else 0) + states.gathered_in_backward() + output_bytes


def offline_room(states: ShardedStates, auto: AutoBudget, device_bytes: int, resident: bool,
                 output_bytes: int, colocated_bytes: int = 0) -> Room:
    """The estimate's room on a device of `device_bytes`: nothing measured; `colocated_bytes` held
    by an engine beside the run (vLLM colocated), taken as the run measures it taken."""
    taken = (states.params + states.frozen_shards if resident else 0) + states.held_whole + states.buffers \
        + colocated_bytes
    return Room(device_bytes, taken, to_come(states, resident, output_bytes), auto.margin(device_bytes)).checked()
