import os
import sys

# Ranks started by fsdp_offload_cfg.testing.dist import test modules by name: keep tests/ importable.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# `pytester`: runs a small test session of its own, for tests of the suite's own isolation
pytest_plugins = ["pytester"]
