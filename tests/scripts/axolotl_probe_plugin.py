"""An axolotl plugin for tests, listed in an axolotl YAML's `plugins:` beside ours: axolotl imports
each listed plugin in every rank (its `load_cfg`), and importing this one installs the Trainer
probe (`trainer_probe_plugin.py`, beside this file; `PYTHONPATH` names the folder), which writes
PROBE_DIR/rank{r}.json after the training (tests/clients/test_axolotl.py). It does nothing else."""

import trainer_probe_plugin  # noqa: F401 - reports after Trainer.train (axolotl's trainers keep the Trainer's)
from axolotl.integrations.base import BasePlugin


class TrainerProbe(BasePlugin):
    """Listed only to be imported: the probe is installed at import."""
