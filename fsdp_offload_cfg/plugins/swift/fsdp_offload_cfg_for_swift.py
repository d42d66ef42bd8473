"""ms-swift's entry: `swift sft --external_plugins $(fsdp-offload-cfg swift-plugin) --fsdp fsdp2.json ...`.

ms-swift imports each `--external_plugins` file in every training process while it parses its
arguments (`BaseArguments.__post_init__`): after its own imports, before it builds the Trainer's
arguments from the `--fsdp` JSON and before any model loads. `patch()` here is therefore in time
for everything the plugin patches, and reads its config from those Trainer arguments as under
`fsdp-offload-cfg run`. A bad config raises here, and ms-swift stops that rank with it.

Why a folder of its own: ms-swift puts the file's folder first on `sys.path`. Next to
`integrations/accelerate.py` or `transformers.py`, this file would make those shadow the real
packages for every later import.
"""

import fsdp_offload_cfg

fsdp_offload_cfg.patch()
