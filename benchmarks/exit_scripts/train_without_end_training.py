"""A user's script that trains and simply ends: no `end_training()`, no `destroy_process_group()`.

    accelerate launch --config_file examples/fsdp2_cpu.yaml benchmarks/exit_scripts/train_without_end_training.py CKPT

Rank-0 loading, FSDP2 on gloo, activation offload (as the config asks), two steps, a loss reduce.
"""

import sys

import fsdp_offload_cfg

fsdp_offload_cfg.patch()

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

accelerator = Accelerator()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(2):
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(step))
    loss = model(input_ids=tokens, labels=tokens).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
accelerator.print(f"loss {accelerator.reduce(loss.detach(), reduction='mean').item():.4f}")
