"""Where accelerate and transformers differ across the supported range, one module per concern.

The rest of the package calls these functions and never compares versions itself:

- `model_init`: how transformers builds a model skeleton on `meta` (init contexts, config base
  class, post-construction patches, what a forward on `meta` needs: `meta_forward`);
- `checkpoint_reading`: which transformers functions read checkpoint data during
  `from_pretrained`, so that `load_strategy: sharded` can swap them for a no-read recorder.

- `model_output`: the name a model output's cache goes by (`cache` from transformers 5.24,
  `past_key_values` before);
- `master_weights`: which parameters accelerate's FSDP2 prepare upcasts to float32 under mixed
  precision (all, the trainable ones, or none in 1.13), for the estimate.
- `unit_layout`: whether accelerate's FSDP2 prepare shards the input embedding as a unit of its
  own (1.14 on) or keeps it in the root with the head, gathered the whole step, for the estimate.
- `ignored_modules`: whether accelerate's FSDP2 prepare keeps the modules `fsdp_ignored_modules`
  names whole (1.11 and later) or shards them like the rest (1.10), for a warning.
- `saving`: where `save_pretrained` writes each weights file, whether it builds new tensors for
  the save (transformers 5's reverse conversions), and whether it writes safetensors at all
  (4.57's `safe_serialization`), for a save that streams the weights (`streamed_save`).

(accelerate's patched entry points kept their names and signatures from 1.10 to 1.15;
`docs/compatibility.md` lists the behaviours that differ.)

Each module decides by feature (is the attribute there?), not by version string, so a patch
release that backports a change keeps working. `docs/compatibility.md` lists what differs.
"""
