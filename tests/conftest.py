import gc
import getpass
import os
import shutil
import sys
import tempfile

# Ranks started by fsdp_offload_cfg.testing.dist import test modules by name: keep tests/ importable.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# `pytester`: runs a small test session of its own, for tests of the suite's own isolation
pytest_plugins = ["pytester"]


# The processes the suite starts (accelerate launch, torchrun, their ranks, the gloo ranks of
# fsdp_offload_cfg.testing.dist) make their temporary folders under one scratch folder, removed
# when the session ends: in the system's temporary directory they stayed, about 170 a run (a
# folder of logs per launch from torchelastic, which never removes them, and the launches' reports).
# This process keeps the system's directory, read before TMPDIR changes: pytest's tmp_path folders
# stay there (the last three runs', as pytest keeps them), and so does multiprocessing's own folder,
# which it removes itself at exit. torch's compile cache stays where torch puts it by default, so a
# second run's launches compile from a warm cache as before.
SYSTEM_TMP = tempfile.gettempdir()
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(SYSTEM_TMP, f"torchinductor_{getpass.getuser()}"))
SCRATCH = tempfile.mkdtemp(prefix="fsdp-offload-cfg-tests-")
os.environ["TMPDIR"] = SCRATCH


def pytest_unconfigure(config) -> None:
    shutil.rmtree(SCRATCH, ignore_errors=True)


def pytest_collection_finish(session) -> None:
    """The suite's own process leaves what collection imported (torch, transformers, the test
    modules: about 380,000 objects) out of its garbage collections, as its gloo ranks do
    (fsdp_offload_cfg.testing.dist): each full collection walked them all, 8.8 s of the 109 s
    that test_estimate.py, test_offload.py and test_plan.py took in this process; 3.6 s frozen."""
    gc.freeze()
