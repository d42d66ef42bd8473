"""The suite's temporary folders: what the processes it starts leave behind is gone when it ends."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent

INNER_SESSION = '''
import os, subprocess, sys
from pathlib import Path


def test_a_child_makes_a_folder_and_compiles_into_the_usual_cache():
    # what torchelastic does for every launch (a folder of logs it never removes), and where a
    # launched rank's torch.compile would put its cache
    child = subprocess.run(
        [sys.executable, "-c", "import tempfile; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
                               "print(tempfile.mkdtemp(prefix='torchelastic_')); print(cache_dir())"],
        capture_output=True, text=True, check=True)
    folder, cache = child.stdout.split()
    Path(RECORD).write_text(folder + " " + cache)
'''


def test_what_the_suites_processes_leave_in_the_temporary_directory_is_gone_when_it_ends(
        pytester: pytest.Pytester, tmp_path: Path) -> None:
    """torchelastic's log folders and the launches' report folders stayed in /tmp, about 170 a run
    of the suite. The compile cache stays out of the scratch folder: removed with it, every run's
    launches would compile from an empty cache."""
    record = tmp_path / "record.txt"
    pytester.makeconftest((HERE / "conftest.py").read_text())
    pytester.makepyfile(f"RECORD = {str(record)!r}\n" + INNER_SESSION)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    folder, cache = record.read_text().split()
    assert Path(folder).parent.name.startswith("fsdp-offload-cfg-tests-"), folder  # in the session's scratch
    assert not Path(folder).parent.exists(), folder
    assert "fsdp-offload-cfg-tests-" not in cache, cache
