"""`benchmarks/activation_offload.py`'s "less grads" column (the activations-at-peak target): the
parts of its meter (`fsdp_offload_cfg.testing.peaks.NonGradientPeak`) that run without a GPU,
for real.

It reads the CUDA allocator's peak at each decoder layer's backward start and takes off the
gradients alive at the reading before. Two things make that figure honest, and both are checked
here, in one process and on 2 gloo ranks under FSDP2, with and without checkpointing, on a Llama
built as the benchmark builds its `none` row:
- its readings come at every layer's backward start and once after backward, never more (a
  recomputed layer must not add one), and they see the gradients grow;
- the gradient bytes it takes off are the bytes the gradients hold, each storage once. FSDP2's
  sharded gradients are views into one reduce-scatter output per layer: counted per parameter,
  that output was counted once for each of its parameters (7.7x the gradients on an earlier run),
  which would have read activations as gradients and flattered the offload.
Only the allocator's peak, which a CPU has not got, is left out (`read` is replaced).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_offload_cfg.compat import allocator
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.models import shard_by_layer
from fsdp_offload_cfg.testing.peaks import NonGradientPeak

LAYERS = 3


def _llama(fsdp2: bool, ac: bool) -> torch.nn.Module:
    """The benchmark's model at a tiny size: hidden, vocab and every dimension even, so FSDP2 pads
    no shard on 2 ranks and storages hold exactly the gradients' elements."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=LAYERS, num_attention_heads=1, num_key_value_heads=1,
                                         max_position_embeddings=128, use_cache=False, attn_implementation="sdpa"))
    if ac:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    return shard_by_layer(model) if fsdp2 else model


def _exact_gradient_bytes(model: torch.nn.Module) -> int:
    """What the gradients hold, counted element by element (a rank's own shard under FSDP2)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()
             if p.grad is not None]
    return sum(g.numel() * g.element_size() for g in grads)


def _readings(rank: int, world_size: int, fsdp2: bool) -> dict[bool, dict[str, Any]]:
    """One training step per checkpointing setting, as the benchmark's row runs it (forward,
    backward, the meter's reading, the optimizer), with the meter's hooks on: the gradient bytes
    at each reading, and the exact ones after backward."""

    class Readings(NonGradientPeak):
        def read(self) -> None:  # the allocator's peak is CUDA's; the gradient count is the meter's own
            self.seen.append(self._gradient_bytes())
            self.exact = _exact_gradient_bytes(self.model)

    results = {}
    for ac in (False, True):
        model = _llama(fsdp2, ac)
        hooks_before = [len(layer._forward_hooks) for layer in model.model.layers]
        meter = Readings(model)
        meter.seen = []
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        meter.read()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        meter.close()
        results[ac] = {"seen": meter.seen, "exact": meter.exact,
                       "hooks_left": [len(layer._forward_hooks) for layer in model.model.layers] == hooks_before}
    return results


def _check(results: dict[bool, dict[str, Any]]) -> None:
    for ac, r in results.items():
        seen = r["seen"]
        assert len(seen) == LAYERS + 1, (ac, seen)  # each layer's backward start, and after backward
        assert seen[0] > 0 and seen == sorted(seen), (ac, seen)  # the head's gradients first, then growing
        assert seen[-1] == r["exact"], (ac, seen[-1], r["exact"])
        assert r["hooks_left"], ac


def test_the_meter_reads_at_each_layer_and_takes_off_exactly_the_gradients():
    with torch.random.fork_rng():  # the benchmark seeds the global RNG: the suite's own state stays as it was
        _check(_readings(0, 1, fsdp2=False))


@pytest.mark.distributed
def test_under_fsdp2_the_meter_counts_each_gradient_storage_once():
    for rank_results in run_workers(_readings, 2, True):
        _check(rank_results)


@pytest.mark.own_code
def test_each_row_is_reported_on_stderr_as_it_ends():
    """The table comes once every row has run; a GPU call's time limit stopped a 3B run at 32k
    tokens with three rows done and none of them printed. Each row now says its figures (or why it
    did not run) on stderr when it ends, before the next row starts."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "activation_offload.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "2", "--hidden", "64",
                           "--seq", "32", "--steps", "1", "--methods", "none", "--ac", "no", "--budget", "1KiB"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    done = [line for line in proc.stderr.splitlines() if line.startswith("[row done in ")]
    assert len(done) == 2, proc.stderr
    assert " none, AC no: peak " in done[0] and " step " in done[0] and " loss " in done[0], done[0]
    assert " budget=1KiB, AC no: not run: ConfigError: " in done[1], done[1]
    assert "| none | no |" in proc.stdout  # the table still follows


@pytest.mark.own_code
def test_expandable_segments_reach_the_rows_allocator_settings():
    """`--expandable-segments` (scripts/gpu_session.sh's part `expandable`) sets the allocator in
    the row's process as `patch()` does: the rows measure what a patched run gets."""
    import subprocess
    import sys
    from pathlib import Path

    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip(f"torch {torch.__version__} does not report its allocator settings (2.13 does)")
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import activation_offload as b; "
            "b.main(['--device', 'cpu', '--layers', '1', '--hidden', '64', '--seq', '16', '--steps', '1', "
            "'--methods', 'none', '--ac', 'no', '--same-process'] + sys.argv[2:]); "
            "print('settings', torch._C._accelerator_getAllocatorSettings())")
    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_VARIABLES}  # the default allocator
    for flag, settings in (([], "settings \n"), (["--expandable-segments"], "settings expandable_segments:True\n")):
        proc = subprocess.run([sys.executable, "-c", code, str(bench), *flag], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.endswith(settings), proc.stdout[-300:]
