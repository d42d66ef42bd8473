#!/usr/bin/env bash
# The main job: FSDP2 training of a tiny local Llama on 2 CPU processes (gloo), configured only by
# examples/fsdp2_cpu.yaml (rank-0 meta loading + activation CPU offload), through accelerate launch.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
fsdp-offload-cfg validate examples/fsdp2_cpu.yaml examples/fsdp2.yaml examples/fsdp2.json
exec accelerate launch --config_file examples/fsdp2_cpu.yaml examples/train.py "$@"
