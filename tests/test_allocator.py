"""The CUDA allocator's expandable segments (`compat.allocator`, patch `cuda-expandable-segments`).

When it is on, from the config and the user's allocator variables; that `patch()` turns it on
in torch's allocator settings and `unpatch()` (or a config without the offload) turns it off.
torch's CPU build keeps the same settings object and reports it (torch 2.13), so these run here;
that a CUDA allocation then gets an expandable segment is `tests/test_offload_cuda.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

import fsdp_offload_cfg
from fsdp_offload_cfg import integrations, patching, registry
from fsdp_offload_cfg.compat import allocator
from fsdp_offload_cfg.config import FSDPOffloadConfig
from fsdp_offload_cfg.offload.options import ActivationOffloadConfig
from fsdp_offload_cfg.registry import LaunchContext
from fsdp_offload_cfg.testing.logs import MessageLog

OFFLOAD = FSDPOffloadConfig(distributed_type="FSDP", version=2,
                            activation_cpu_offload=ActivationOffloadConfig(enabled=True), source="<test>")
NO_OFFLOAD = dataclasses.replace(OFFLOAD, activation_cpu_offload=ActivationOffloadConfig())
BUDGET = dataclasses.replace(NO_OFFLOAD, activation_memory_budget="auto")
CUDA = LaunchContext(world_size=2, launcher=True, accelerator=True, cuda_allocator=True)
NO_CUDA = dataclasses.replace(CUDA, cuda_allocator=False)  # a CPU or ROCm build of torch


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in (*allocator.USER_VARIABLES, "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.delenv(key)
    fsdp_offload_cfg.unpatch()
    yield
    fsdp_offload_cfg.unpatch()


def _expandable_now() -> bool | None:
    settings = allocator.settings_now()
    if settings is None:
        pytest.skip(f"torch {torch.__version__} does not report its allocator settings (2.13 does)")
    return allocator.stated_expandable(settings)


@pytest.mark.parametrize(("cfg", "ctx", "variable", "wanted"), [
    (OFFLOAD, CUDA, None, True),  # the offload on CUDA: on by default
    (BUDGET, CUDA, None, True),  # a budget's plan offloads too
    (NO_OFFLOAD, CUDA, None, False),  # nothing of ours fragments the allocator: torch's default
    (OFFLOAD, NO_CUDA, None, False),
    (dataclasses.replace(OFFLOAD, use_cpu=True), CUDA, None, False),  # the ranks compute on the CPU
    (OFFLOAD, CUDA, ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512"), False),  # the allocator is the user's
    (OFFLOAD, CUDA, ("PYTORCH_ALLOC_CONF", "expandable_segments:False"), False),
    (dataclasses.replace(OFFLOAD, expandable_segments=False), CUDA, None, False),
    (dataclasses.replace(NO_OFFLOAD, expandable_segments=True), CUDA, None, True),  # asked for: also without offload
    (dataclasses.replace(OFFLOAD, expandable_segments=True), CUDA, ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512"),
     True),  # the variable says nothing of them
    (dataclasses.replace(OFFLOAD, expandable_segments=True), CUDA,
     ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"), False),  # the launch's environment wins over the file
])
def test_when_expandable_segments_are_wanted(cfg, ctx, variable, wanted, monkeypatch: pytest.MonkeyPatch):
    if variable is not None:
        monkeypatch.setenv(*variable)
    assert integrations.expandable_segments_wanted(cfg, ctx) is wanted
    described = [d.split(":")[0] for d in patching.describe_patches(cfg, ctx)]  # what `explain` lists
    assert (registry.EXPANDABLE_SEGMENTS in described) is wanted


def test_the_offload_turns_them_on_in_torchs_settings_and_unpatch_turns_them_off():
    assert _expandable_now() is not True
    session = registry.install(integrations.plan_for(OFFLOAD, "<test>", CUDA))
    assert _expandable_now() is True
    assert registry.EXPANDABLE_SEGMENTS in session.patch_names  # rank 0's line names it
    fsdp_offload_cfg.unpatch()
    assert _expandable_now() is False


def test_a_config_that_arrives_later_switches_them():
    """The Trainer's `fsdp_config` replaces the script's config (`registry.switch`): the offload
    arriving turns them on, a config without it turns them off again."""
    session = registry.install(integrations.plan_for(NO_OFFLOAD, "<script>", CUDA))
    assert _expandable_now() is not True and registry.EXPANDABLE_SEGMENTS not in session.patch_names
    registry.switch(integrations.plan_for(OFFLOAD, "<trainer>", CUDA))
    assert _expandable_now() is True and registry.EXPANDABLE_SEGMENTS in session.patch_names
    registry.switch(integrations.plan_for(NO_OFFLOAD, "<trainer>", CUDA))
    assert _expandable_now() is False and registry.EXPANDABLE_SEGMENTS not in session.patch_names


def test_a_failing_install_leaves_them_as_they_were(monkeypatch: pytest.MonkeyPatch):
    def broken(original, cfg):
        raise RuntimeError("builder failed")

    failing = patching.Patch("failing", "accelerate.accelerator", "Accelerator.prepare", broken,
                             lambda c, ctx: True, ("accelerate",), "fails while installing")
    monkeypatch.setattr(integrations, "PATCHES", [*integrations.PATCHES, failing])
    with pytest.raises(RuntimeError, match="builder failed"):
        registry.install(integrations.plan_for(OFFLOAD, "<test>", CUDA))
    assert _expandable_now() is not True and registry.active() is None


def test_a_file_asking_for_them_against_the_users_variable_is_told_the_variable_wins(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    cfg = dataclasses.replace(OFFLOAD, expandable_segments=True)
    with MessageLog("fsdp_offload_cfg.integrations", logging.WARNING) as log:
        session = registry.install(integrations.plan_for(cfg, "fsdp2.yaml", CUDA))
        integrations.log_active(session)
    assert registry.EXPANDABLE_SEGMENTS not in session.patch_names
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False says otherwise: the variable wins" in m
               for m in log), list(log)


@pytest.mark.parametrize(("text", "stated"), [
    ("expandable_segments:True", True), ("max_split_size_mb:64,expandable_segments:false", False),
    ("expandable_segments:True,expandable_segments:False", False), ("max_split_size_mb:64", None), ("", None),
])
def test_what_an_allocator_setting_says(text, stated):
    assert allocator.stated_expandable(text) is stated


_CUDA_PROBE = """
import json, sys, torch, fsdp_offload_cfg
fsdp_offload_cfg.patch({"distributed_type": "FSDP", "fsdp_config": json.loads(sys.argv[1])})
assert not torch.cuda.is_initialized(), "patch() started CUDA: a DataLoader's forked workers could not"
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
print(json.dumps(sorted({segment["is_expandable"] for segment in torch.cuda.memory_snapshot()})))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("fsdp_config", "variable", "expandable"), [
    ({"fsdp_version": 2, "activation_cpu_offload": True}, None, [True]),
    ({"fsdp_version": 2, "activation_cpu_offload": True, "expandable_segments": False}, None, [False]),
    ({"fsdp_version": 2, "activation_cpu_offload": True}, "max_split_size_mb:512", [False]),
    ({"fsdp_version": 2}, None, [False]),
])
def test_on_cuda_the_segments_allocated_after_patch_are_expandable(fsdp_config, variable, expandable):
    """In a fresh process: what `patch()` sets reaches the CUDA allocator (its segments say so),
    and setting it does not start CUDA."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_VARIABLES}
    if variable is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = variable
    out = subprocess.run([sys.executable, "-c", _CUDA_PROBE, json.dumps(fsdp_config)], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == expandable, out
