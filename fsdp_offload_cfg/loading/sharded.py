"""Strategy "sharded" (not implemented yet): every rank reads only its own slices from the
safetensors files, so no rank ever holds the full model and nothing is sent over the network.

It plugs in where `broadcast.scatter_from_rank0` does: given the same `layout.Target` list, each
rank would open the checkpoint files (from `model.config.name_or_path` and the safetensors index)
and fill `target.dest` from `safe_open(file).get_slice(target.spec.name)[target.regions[rank]]`,
casting floats to the destination dtype as the broadcast path does. Checkpoint key renames
(transformers' weight conversions, e.g. fused experts) must be applied first; that is the hard part.
"""

from __future__ import annotations

from fsdp_offload_cfg.loading.layout import Target

NOT_IMPLEMENTED = (
    "load_strategy='sharded' (each rank reads its own slices with safetensors get_slice) is not implemented "
    "yet; use load_strategy='broadcast'"
)


def read_own_shards(targets: list[Target], checkpoint_files: list[str], rank: int) -> None:
    """Fill each target's `dest` with this rank's region, read straight from the checkpoint."""
    raise NotImplementedError(NOT_IMPLEMENTED)
