"""The safetensors file a streamed save writes tensor by tensor (`safetensors_writer`): byte for
byte the file `safetensors.torch.save_file` writes from all its tensors at once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_offload_cfg import safetensors_writer


def _tensors() -> dict[str, torch.Tensor]:
    """Every dtype a model holds, out of the order their bytes take, an empty one among them."""
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.weight": torch.randn(3, 5, generator=g),
        "model.embed.weight": torch.randn(7, 2, generator=g).bfloat16(),
        "model.norm.weight": torch.randn(4, generator=g).half(),
        "position_ids": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
        "scales": torch.randn(2, generator=g).double(),
        "counts": torch.tensor([1, 2], dtype=torch.int32),
        "codes": torch.tensor([1, -2, 3], dtype=torch.int8),
        "empty": torch.randn(0, 4, generator=g),
    }


@pytest.mark.parametrize("metadata", [{"format": "pt"}, None])
@pytest.mark.parametrize("blocks", [False, True])
def test_a_file_written_tensor_by_tensor_is_the_one_save_file_writes(tmp_path: Any, metadata: Any,
                                                                     blocks: bool) -> None:  # fmt: skip
    """`blocks`: each tensor handed over as its row blocks of 2 (a weight gathered from its row
    shards), written without joining them."""
    from safetensors.torch import save_file

    tensors = _tensors()
    save_file(tensors, str(tmp_path / "whole.safetensors"), metadata=metadata)
    writer = safetensors_writer.FileWriter(str(tmp_path / "streamed.safetensors"),
                                           {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, metadata)  # fmt: skip
    for name in writer.order:
        writer.append(name, *(tensors[name].split(2) if blocks else [tensors[name]]))
    writer.close()
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()


def test_a_tensor_out_of_the_headers_order_or_shape_is_refused(tmp_path: Any) -> None:
    tensors = _tensors()
    writer = safetensors_writer.FileWriter(str(tmp_path / "x.safetensors"),
                                           {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, None)  # fmt: skip
    first, second = writer.order[:2]
    with pytest.raises(ValueError, match=f"{second} .* written where the header has {first}"):
        writer.append(second, tensors[second])
    with pytest.raises(ValueError, match="written where the header has"):
        writer.append(first, tensors[first][:1])
    writer.close()


def test_a_dtype_the_writer_does_not_know_is_said_so() -> None:
    assert safetensors_writer.writable(torch.bfloat16) and safetensors_writer.writable(torch.bool)
    assert not safetensors_writer.writable(torch.complex64)
