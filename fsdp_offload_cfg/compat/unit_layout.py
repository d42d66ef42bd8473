"""How accelerate's FSDP2 prepare groups what the layer classes leave (the input embedding, the
final norm, the output head): what the estimate counts as gathered units and as gathered for the
whole step. Read off each release's `fsdp2_prepare_model`:

- 1.10-1.13: `fully_shard` on each layer, then on the root, with the config's
  `reshard_after_forward`: the root holds the embedding, the final norm and the head together;
  resharded after forward (by default), it is gathered again as backward starts and stays so to
  its end, so all three are gathered through forward and backward alike (measured on gloo:
  `tests/test_estimate.py::test_reshard_after_forward_false_keeps_every_unit_gathered_into_backward`);
- 1.14 on: the untied embedding is a unit of its own (gathered for its forward and its backward
  alone), and [final norm, head] (the embedding with them when tied) a tail kept gathered from
  forward to backward, the root left to FSDP2's default (kept gathered).

Decided from the installed function's code (the tail's `_find_final_norm`), not its version
number, so a backport keeps working.
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def embedding_is_a_unit() -> bool:
    """Whether `fsdp2_prepare_model` shards an untied input embedding as a unit of its own (1.14
    on); else the root holds it, gathered for the whole step beside the head."""
    from accelerate.utils import fsdp_utils

    try:
        code = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    except (OSError, TypeError):  # no source shipped: assume the current release's layout
        return True
    return "_find_final_norm" in code
