import pytest
import torch
import torch.distributed as dist

from _dist import run_workers


def _allreduce(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank 1")


def test_gloo_allreduce_is_real():
    assert run_workers(_allreduce, 2) == [3.0, 3.0]


def test_rank_error_is_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_workers(_fail_on_rank1, 2)
