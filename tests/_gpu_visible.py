"""pytest plugin (`-p _gpu_visible`): the machine shows a CUDA GPU to every availability check.

For tests that must hold whatever the machine has (`tests/test_gpu_visible.py`): CPU tests that
read "is there a GPU?" must pin their answer, as the first GPU run of the suite showed they did
not. Nothing here touches a device; tests that would really use CUDA are not run under it.
"""

import torch

torch.cuda.is_available = lambda: True  # type: ignore[assignment]
