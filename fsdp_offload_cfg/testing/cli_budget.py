"""What the framework-CLI budget tests share (`tests/clients`): the budget they run at, and the
log lines that prove the layers were planned."""

from __future__ import annotations

# stated, so that the run's plan is the estimate's on every machine (measured rates vary)
RATES = {"fsdp_activation_budget_compute_tflops": 0.05, "fsdp_activation_budget_copy_gb_per_s": 5}


def smallest_budget(model_dir: str, seq_len: int, batch_size: int = 2) -> int:
    """The smallest activation peak a plan reaches at the longest batch, 2 ranks: every batch of the
    run fits it, and each saves less than the plain run would, so the plan has to move something."""
    from fsdp_offload_cfg import load_config
    from fsdp_offload_cfg.estimate import estimate_memory

    config = load_config({"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {
        "fsdp_version": 2, "fsdp_activation_memory_budget": 2**40, **RATES}})
    uniform = estimate_memory(config, model_dir, seq_len=seq_len, batch_size=batch_size, device="cpu",
                              dtype="float32")["plan"]["uniform"]
    return min(u["device_peak_bytes"] for u in uniform.values())


def assert_planned_per_layer(stderr: str) -> None:
    """Rank 0 said the budget is on, and logged a plan that offloads or checkpoints a layer."""
    plans = [line for line in stderr.splitlines() if "[fsdp_offload_cfg rank 0]" in line
             and "tokens per rank: layer" in line]
    assert plans and any("offload" in line or "checkpoint" in line for line in plans), stderr[-3000:]
    assert "activation offload: planned per layer to activation_memory_budget" in stderr, stderr[-3000:]
