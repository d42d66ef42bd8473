"""A batch of text alone on one rank of a sharded vision-language model (`vision_sync.py`).

Before: rank 0 (an image) all-gathered the vision tower while rank 1 (text alone) all-gathered
the text layers; gloo aborted rank 0 ("Received data size doesn't match expected size") and
rank 1 trained on; NCCL stalls until its watchdog. Now the rank without images runs the tower
on the other rank's pixels with gradients of zero, and the run equals one process stepping on
the mean of both ranks' losses: the reference here, computed without FSDP.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch

from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers

pytestmark = pytest.mark.distributed

# what each rank's batch holds, step by step: an image on each rank alone, then on neither, then on
# both; for "videos", an image on one rank and a video on the other (each runs the other's tower)
SCHEDULES = {"images": [("image", "text"), ("text", "image"), ("text", "text"), ("image", "image")],
             "videos": [("image", "video"), ("video", "text"), ("text", "image"), ("video", "video")]}  # fmt: skip
LR = 0.5  # plain SGD: a gradient off by a scale or a term shows in the weights (AdamW would normalise it away)


def _batch(family: str, forward: Any, kind: str, seed: int) -> dict[str, torch.Tensor]:
    """One sequence with an image, a video (Qwen2-VL only) or text alone (`kind`)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 90 if family == "llava" else 100, (1, 16), generator=g)
    batch: dict[str, torch.Tensor] = {}
    if kind == "image" and family == "llava":
        ids[0, 2:6] = 96
        batch["pixel_values"] = torch.randn(1, 3, 16, 16, generator=g)
    elif kind == "image":  # 16 patches of 3x2x4x4 values, merged 2x2 into 4 tokens
        ids[0, 2:6] = 120
        batch.update(pixel_values=torch.randn(16, 96, generator=g), image_grid_thw=torch.tensor([[1, 4, 4]]))
    elif kind == "video":  # two frames deep: 32 patches, 8 tokens
        ids[0, 2:10] = 121
        batch.update(pixel_values_videos=torch.randn(32, 96, generator=g), video_grid_thw=torch.tensor([[2, 4, 4]]))
    batch["input_ids"] = ids
    if "mm_token_type_ids" in inspect.signature(forward).parameters:  # transformers >= 5.24's M-RoPE input
        batch["mm_token_type_ids"] = (ids == 120).long() + 2 * (ids == 121).long()
    batch["labels"] = ids.clone()
    return batch


def _model_class(family: str) -> Any:
    from transformers import LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration

    return LlavaForConditionalGeneration if family == "llava" else Qwen2VLForConditionalGeneration


def _train_worker(rank: int, world_size: int, path: str, family: str, mode: str, offload: bool,
                  version: int, frozen: bool, schedule: str) -> dict[str, Any]:  # fmt: skip
    import fsdp_offload_cfg

    keys: dict[str, Any] = {"fsdp_version": version, **({"activation_cpu_offload": True} if offload else {})}
    if version == 1:  # FSDP1 on the CPU: no module-state sync (it needs a GPU); one flat parameter per dtype
        keys.update(fsdp_sync_module_states=False, fsdp_use_orig_params=True)
    fsdp_offload_cfg.patch(loader_config(mode, **keys))
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    accelerator = Accelerator()
    model = _loaded(path, family, frozen)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step, kinds in enumerate(SCHEDULES[schedule]):
        loss = model(**_batch(family, model.forward, kinds[rank], 10 * step + rank)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():  # an evaluation forward: the tower's all-gathers alone
        losses.append(model(**_batch(family, model.forward, "image" if rank == 0 else "text", 99 + rank)).loss.item())
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone().numpy()
                      for n, p in model.named_parameters()}  # fmt: skip
    else:
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
                  for n, p in model.named_parameters()}  # fmt: skip
    return {"losses": losses, "params": params}


def _loaded(path: str, family: str, frozen: bool) -> Any:
    model = _model_class(family).from_pretrained(path)
    if frozen:
        for name, p in model.named_parameters():
            p.requires_grad_("vision" not in name and "projector" not in name)
    return model


def _reference(path: str, family: str, frozen: bool, schedule: str) -> dict[str, Any]:
    """One process, no FSDP: each step on the mean of both ranks' losses (FSDP averages the ranks'
    gradients), a rank's loss on text alone as its forward gives it."""
    model = _loaded(path, family, frozen)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[list[float]] = [[], []]
    for step, kinds in enumerate(SCHEDULES[schedule]):
        per_rank = [model(**_batch(family, model.forward, kinds[r], 10 * step + r)).loss for r in (0, 1)]
        ((per_rank[0] + per_rank[1]) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        for r in (0, 1):
            losses[r].append(per_rank[r].item())
    model.eval()
    with torch.no_grad():
        for r in (0, 1):
            losses[r].append(model(**_batch(family, model.forward, "image" if r == 0 else "text", 99 + r)).loss.item())
    return {"losses": losses, "params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("family, mode, offload, version, frozen, schedule", [
    ("llava", "loader_off", False, 2, False, "images"),
    ("llava", "sharded", True, 2, False, "images"),
    ("qwen2_vl", "loader_off", False, 2, False, "images"),
    ("qwen2_vl", "loader_off", False, 2, False, "videos"),
    ("llava", "loader_off", False, 2, True, "images"),  # the tower and projector frozen: their forward alone
    ("llava", "loader_off", False, 1, False, "images"),
])  # fmt: skip
def test_a_rank_with_text_alone_trains_beside_ranks_with_images(tmp_path: Any, family: str, mode: str, offload: bool,
                                                                 version: int, frozen: bool,
                                                                 schedule: str) -> None:  # fmt: skip
    from fsdp_offload_cfg.testing.models import save_llava, save_qwen2_vl

    path = (save_llava if family == "llava" else save_qwen2_vl)(str(tmp_path / family))
    ranks = run_workers(_train_worker, 2, path, family, mode, offload, version, frozen, schedule, timeout=240,
                        pg_timeout=60)  # fmt: skip
    reference = _reference(path, family, frozen, schedule)
    for rank, result in enumerate(ranks):
        np.testing.assert_allclose(result["losses"], reference["losses"][rank], rtol=1e-5)
        assert result["params"].keys() == reference["params"].keys()
        for name, value in reference["params"].items():
            np.testing.assert_allclose(result["params"][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    vision = [n for n in reference["params"] if "vision" in n or "visual" in n]
    moved = [not np.array_equal(ranks[0]["params"][n], _initial(path, family)[n]) for n in vision]
    assert vision and (not any(moved) if frozen else any(moved))


def _initial(path: str, family: str) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy() for n, p in _model_class(family).from_pretrained(path).named_parameters()}


class _TinyVLM(torch.nn.Module):
    """A text-and-pixels model with no `get_image_features`: nothing to run a stand-in with."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.vision = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 10)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if pixel_values is not None:
            hidden = hidden + self._features(pixel_values).mean()
        return self.head(hidden).sum()

    def _features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision(pixel_values)


class _TinyVLMWithFeatures(_TinyVLM):
    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self._features(pixel_values)


def _embeds_worker(rank: int, world_size: int) -> dict[str, Any]:
    """`inputs_embeds` from the script's own (unsharded) embedding: the model embeds nothing, so
    a rank without pixels runs the tower before its forward, as the others do inside theirs."""
    import copy

    from torch.distributed.fsdp import fully_shard

    from fsdp_offload_cfg import vision_sync

    torch.manual_seed(0)
    model = _TinyVLMWithFeatures()
    plain = copy.deepcopy(model)
    fully_shard(model.vision)
    fully_shard(model)
    vision_sync.sync_vision(model)
    embeds = torch.nn.Embedding(10, 8)
    pixels = {"pixel_values": torch.ones(1, 4)} if rank == 0 else {}
    loss = model(inputs_embeds=embeds(torch.tensor([[1, 2, 3]])), **pixels)
    loss.backward()
    vision_sync.remove(model)
    alone = plain(inputs_embeds=embeds(torch.tensor([[1, 2, 3]])), pixel_values=torch.ones(1, 4))
    alone.backward()
    return {"loss": loss.item(), "plain_loss": plain(inputs_embeds=embeds(torch.tensor([[1, 2, 3]])), **pixels).item(),
            "vision_grad": model.vision.weight.grad.full_tensor().numpy(),
            "rank0_grad": plain.vision.weight.grad.numpy()}  # fmt: skip


def test_a_rank_passing_inputs_embeds_runs_the_tower_before_its_forward() -> None:
    ranks = run_workers(_embeds_worker, 2, timeout=120, pg_timeout=30)
    for result in ranks:
        assert result["loss"] == result["plain_loss"]  # the stand-in adds exactly nothing
        np.testing.assert_allclose(result["vision_grad"], ranks[0]["rank0_grad"] / 2, rtol=1e-6)  # rank 1 adds 0


def _embeds_offload_worker(rank: int, world_size: int) -> dict[str, Any]:
    """As `_embeds_worker`, with the activation offload on the VLM (its root) and the tower a group of
    it: the stand-in runs in the forward's pre-hook, before the forward the offload wraps."""
    import logging

    from torch.distributed.fsdp import fully_shard

    from fsdp_offload_cfg import vision_sync
    from fsdp_offload_cfg.offload import enable_activation_offload, offload_stats
    from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
    from fsdp_offload_cfg.testing.logs import MessageLog

    torch.manual_seed(0)
    model = _TinyVLMWithFeatures()
    fully_shard(model.vision)
    fully_shard(model)
    vision_sync.sync_vision(model)
    handle = enable_activation_offload(model, ActivationOffloadConfig(enabled=True, min_tensor_bytes=0,
                                                                      offload_last_group=True), groups=[model.vision])
    embeds = torch.nn.Embedding(10, 8)
    pixels = {"pixel_values": torch.ones(1, 4)} if rank == 0 else {}
    with MessageLog("fsdp_offload_cfg.offload", logging.WARNING) as said:
        model(inputs_embeds=embeds(torch.tensor([[1, 2, 3]])), **pixels).backward()
    handle.remove()
    vision_sync.remove(model)
    return {"offloaded": offload_stats()["offloaded_bytes"], "warnings": list(said)}


def test_a_rank_passing_inputs_embeds_runs_the_stand_in_tower_inside_the_offload() -> None:
    """Before: rank 1's stand-in ran before the forward the offload installed, so its tower's
    activations stayed on the device, and the offload warned that a layer ran outside it."""
    for rank, result in enumerate(run_workers(_embeds_offload_worker, 2, timeout=120, pg_timeout=30)):
        assert not [w for w in result["warnings"] if "outside the offload" in w], (rank, result["warnings"])
        assert result["offloaded"] > 0, rank  # the tower's input (its one saved tensor) left the device


def _refusal_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from fsdp_offload_cfg import vision_sync

    torch.manual_seed(0)
    text_only = fully_shard(torch.nn.Sequential(torch.nn.Embedding(10, 8)))
    unsharded = vision_sync.sync_vision(_TinyVLM())  # an evaluation copy, whole on each rank
    model = _TinyVLM()
    fully_shard(model.vision)
    fully_shard(model)
    hooked = vision_sync.sync_vision(model)
    ids = torch.tensor([[1, 2, 3]])
    same = model(ids, pixel_values=torch.ones(1, 4)).item()  # every rank has pixels: runs as written
    try:
        model(ids, pixel_values=torch.ones(1, 4) if rank == 0 else None)
        message = None
    except RuntimeError as error:
        message = str(error)
    vision_sync.remove(model)
    return {"text_only": vision_sync.sync_vision(text_only), "unsharded": unsharded, "hooked": hooked is model,
            "same": same, "message": message}  # fmt: skip


def test_a_model_without_a_feature_method_raises_on_every_rank_at_once() -> None:
    ranks = run_workers(_refusal_worker, 2, timeout=120, pg_timeout=30)
    for result in ranks:
        assert result["hooked"] and result["text_only"] is None and result["unsharded"] is None
        assert result["same"] == ranks[0]["same"]
        message = result["message"]
        assert message is not None and "ranks [0] have pixel_values" in message and "ranks [1] do not" in message
        assert "get_image_features" in message and "give every rank's batch" in message
