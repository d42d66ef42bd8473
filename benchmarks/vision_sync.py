"""What the vision tower on every rank costs (`fsdp_offload_cfg/vision_sync.py`).

A Llava (CLIP tower, Llama text model) built locally, FSDP2 through accelerate on `--ranks` gloo
CPU ranks, one sequence of `--seq-len` tokens per rank, SGD. Each row trains `--steps` steps
after `--warmup` and prints the median step (forward, backward, optimizer) of the slowest rank:

  text on every rank, hook off / on     what the hook costs where no rank has images (the
                                        two-integer all-gather of each forward)
  images on every rank, hook off / on   the same where every rank has them
  an image on rank 0 alone, hook on     the stand-in: the other ranks receive rank 0's pixels
                                        and run the tower on them (without the hook this row
                                        does not run: the ranks' collectives no longer pair up)

"hook off" is the model with the hook removed (`vision_sync.remove`), as stock accelerate runs
it. Below the table: the flag all-gather alone, median of 200 calls.

    python benchmarks/vision_sync.py [--ranks 2] [--seq-len 256] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

ROWS = [("text on every rank", "text", False), ("text on every rank", "text", True),
        ("images on every rank", "image", False), ("images on every rank", "image", True),
        ("an image on rank 0 alone", "mixed", True)]  # fmt: skip
# each hook-on row against: the same batches without the hook; the stand-in row against images on
# every rank (what a script must feed stock accelerate to run at all, LlamaFactory's placeholder image)
BASELINE = {1: 0, 3: 2, 4: 2}
IMAGE_TOKEN, IMAGE_SIZE, PATCH = 500, 64, 8  # 64 image tokens per image


def _save_llava(path: str) -> str:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH)  # fmt: skip
    text = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)  # fmt: skip
    LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                              image_token_index=IMAGE_TOKEN)).save_pretrained(path)  # fmt: skip
    return path


def _batch(image: bool, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, IMAGE_TOKEN, (1, seq_len), generator=g)
    batch = {"input_ids": ids}
    if image:
        ids[0, 1:1 + (IMAGE_SIZE // PATCH) ** 2] = IMAGE_TOKEN
        batch["pixel_values"] = torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    batch["labels"] = ids.clone()
    return batch


def _worker(rank: int, world_size: int, path: str, seq_len: int, warmup: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import fsdp_offload_cfg
    from fsdp_offload_cfg import model_state, vision_sync
    from fsdp_offload_cfg.testing.configs import loader_config

    fsdp_offload_cfg.patch(loader_config("loader_off"))
    from accelerate import Accelerator
    from transformers import LlavaForConditionalGeneration

    accelerator = Accelerator()
    model = LlavaForConditionalGeneration.from_pretrained(path)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    hooked = next(m for m in model.modules() if model_state.get(m, "vision_sync") is not None)
    medians = []
    for _, kind, hook in ROWS:
        if not hook:
            vision_sync.remove(hooked)
        times = []
        for step in range(warmup + steps):
            image = kind == "image" or (kind == "mixed" and rank == 0)
            batch = _batch(image, seq_len, step * world_size + rank)
            dist.barrier()
            start = time.perf_counter()
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times[warmup:]))
        if not hook:
            vision_sync.sync_vision(model)
    flags = []
    for _ in range(200):
        start = time.perf_counter()
        vision_sync._all_gather_flags([True, False], vision_sync._group())
        flags.append(time.perf_counter() - start)
    return {"medians": medians, "flags": statistics.median(flags)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from fsdp_offload_cfg.testing.dist import run_workers

    with tempfile.TemporaryDirectory() as tmp:
        path = _save_llava(f"{tmp}/llava")
        ranks = run_workers(_worker, args.ranks, path, args.seq_len, args.warmup, args.steps, timeout=1800)
    slowest = [max(r["medians"][i] for r in ranks) for i in range(len(ROWS))]
    print(f"Llava (CLIP 6x256, Llama 6x256), {args.ranks} gloo ranks, 1 x {args.seq_len} tokens per rank, "
          f"median of {args.steps} steps, slowest rank\n")
    print("| batches | hook | step ms | against |")
    print("|---|---|---|---|")
    for i, (label, _, hook) in enumerate(ROWS):
        against = ""
        if i in BASELINE:
            base = BASELINE[i]
            against = f"{slowest[i] / slowest[base]:.2f}x {ROWS[base][0]}, hook off"
        print(f"| {label} | {'on' if hook else 'off'} | {slowest[i] * 1e3:.1f} | {against} |")
    print(f"\nflag all-gather alone: {max(r['flags'] for r in ranks) * 1e6:.0f} us (median of 200, slowest rank)")


if __name__ == "__main__":
    main()
