"""Train a tiny Llama with FSDP2, configured only by the accelerate config file it is launched with.

    accelerate launch --config_file examples/fsdp2_cpu.yaml examples/train.py

The one line that matters is `fsdp_offload_cfg.patch()`, before `Accelerator()` and before
`from_pretrained`: it finds the launch file, validates it (a typo'd key stops here, named), turns
on rank-0 meta loading and activation CPU offload as the file asks, and runs FSDP2 on gloo when
there is no GPU. No hub access: the checkpoint is built from a config and saved to a temp dir.
"""

from __future__ import annotations

import fsdp_offload_cfg

fsdp_offload_cfg.patch()

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import broadcast_object_list  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", default=None, help="existing HF checkpoint dir (default: build a tiny one)")
    parser.add_argument("--output-dir", default=None, help="save the trained model there, as from_pretrained reads it")
    return parser.parse_args()


def build_tiny_llama(path: str, args: argparse.Namespace) -> None:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(256, args.seq),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def shared_checkpoint_dir(accelerator: Accelerator, args: argparse.Namespace) -> tuple[str, bool]:
    """Rank 0 builds and saves the tiny checkpoint; every rank learns its path."""
    if args.checkpoint:
        return args.checkpoint, False
    holder = [tempfile.mkdtemp(prefix="fsdp_offload_cfg_demo_") if accelerator.is_main_process else None]
    broadcast_object_list(holder)
    if accelerator.is_main_process:
        build_tiny_llama(holder[0], args)
    accelerator.wait_for_everyone()
    return holder[0], True


def stop_if_run_alone(accelerator: Accelerator) -> None:
    """`torchrun --nproc_per_node 2 examples/train.py` with no config named: stock accelerate on a
    machine without a GPU runs each process as a job of its own, and each would build, train and
    remove a model of its own. Every rank stops, saying how to name the file (no rank waits on
    another: no process group exists)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        sys.exit(f"examples/train.py: launched as {launched} processes, but Accelerator() runs this one "
                 f"alone: no accelerate config reached it. Name one: FSDP_OFFLOAD_CFG=examples/fsdp2_cpu.yaml "
                 f"torchrun --nproc_per_node {launched} examples/train.py, or "
                 f"accelerate launch --config_file examples/fsdp2_cpu.yaml examples/train.py")


def main() -> None:
    args = parse_args()
    accelerator = Accelerator()
    stop_if_run_alone(accelerator)
    if not accelerator.is_main_process:
        transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar, rank 0's
    path, owned = shared_checkpoint_dir(accelerator, args)
    try:
        train(accelerator, path, args)
        accelerator.wait_for_everyone()  # every rank is done with the files before rank 0 removes them
    finally:  # the built checkpoint goes, whether training finished or not
        if owned and accelerator.is_main_process:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.end_training()


def train(accelerator: Accelerator, path: str, args: argparse.Namespace) -> None:
    model = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)

    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    accelerator.print(
        f"distributed_type={accelerator.distributed_type.value} processes={accelerator.num_processes} "
        f"device={accelerator.device} sharded_params={len(sharded)}/{len(list(model.parameters()))}"
    )

    # one fixed batch per rank, seen every step: the loss falls as the model learns it (new random
    # tokens each step would keep it flat at log(vocab), whatever the training does)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=generator)
    tokens = tokens.to(accelerator.device)
    start = time.perf_counter()
    for step in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
        accelerator.print(f"step {step} loss {mean_loss:.4f}")
    accelerator.print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f}s")
    if fsdp_offload_cfg.active_config() and fsdp_offload_cfg.active_config().activation_cpu_offload.enabled:
        accelerator.print(f"activation offload stats: {fsdp_offload_cfg.offload_stats()}")
    if args.output_dir:  # on every rank: the sharded weights are gathered, and rank 0 writes them
        accelerator.unwrap_model(model).save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process)
        accelerator.print(f"saved the trained model to {args.output_dir}")


if __name__ == "__main__":
    main()
