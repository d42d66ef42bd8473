"""`python -m fsdp_offload_cfg` == the `fsdp-offload-cfg` console script."""

from fsdp_offload_cfg.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
