"""Put first on `PYTHONPATH` by tests/clients/test_axolotl.py for `axolotl train` on a CPU machine,
and nothing else: axolotl 0.19 builds its device mesh for "cuda" whatever the machine has
(`axolotl.utils.distributed.build_parallelism_config`). Where no CUDA device exists, that mesh is
built for the CPU (gloo), as the rest of the run already is. No code of this package is here."""

import torch
from accelerate.parallelism_config import ParallelismConfig

_build_device_mesh = ParallelismConfig.build_device_mesh


def _build_on_the_cpu_without_cuda(self, device_type):
    if device_type == "cuda" and not torch.cuda.is_available():
        device_type = "cpu"
    return _build_device_mesh(self, device_type)


ParallelismConfig.build_device_mesh = _build_on_the_cpu_without_cuda
