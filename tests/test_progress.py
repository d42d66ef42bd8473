"""Load progress: a bar with bytes, tensors, rate and time left on a terminal, once per node;
nothing in a log file (the summary line each strategy logs is all)."""

from __future__ import annotations

import io

import pytest

from fsdp_offload_cfg.loading.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_bytes_tensors_rate_and_time_left(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    stream = Terminal()
    with Progress(4 * 2**20, "rank 0 sending to 3 ranks", stream, min_interval_s=0) as progress:
        for _ in range(4):
            progress.update(2**20, tensors=2)
    out = stream.getvalue()
    assert "rank 0 sending to 3 ranks" in out and "4.00M" in out and "8 tensors" in out, out
    assert "B/s" in out and "<" in out, out  # rate, and tqdm's elapsed<left


@pytest.mark.parametrize("local_rank, stream", [("0", io.StringIO()), ("1", Terminal())])
def test_a_log_file_and_the_other_ranks_of_a_node_get_nothing(monkeypatch: pytest.MonkeyPatch, local_rank: str,
                                                               stream: io.StringIO):
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with Progress(2**20, "reading", stream) as progress:
        progress.update(2**20, tensors=1)
    assert stream.getvalue() == "" and progress.tensors == 1
