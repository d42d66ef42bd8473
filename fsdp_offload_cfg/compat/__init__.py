"""Where accelerate and transformers differ across the supported range, one module per concern.

The rest of the package calls these functions and never compares versions itself:

- `model_init`: how transformers builds a model skeleton on `meta` (init contexts, config base
  class, post-construction patches, what a forward on `meta` needs: `meta_forward`);
- `checkpoint_reading`: which transformers functions read checkpoint data during
  `from_pretrained`, so that `load_strategy: sharded` can swap them for a no-read recorder.

(accelerate's differences in the range need no code: its patched entry points kept their names
and signatures from 1.10 to 1.15; `docs/compatibility.md` lists the behaviours that differ.)

Each module decides by feature (is the attribute there?), not by version string, so a patch
release that backports a change keeps working. `docs/compatibility.md` lists what differs.
"""
