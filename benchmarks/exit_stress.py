"""Do finished runs exit 0? Launch user-shaped scripts many times in a row and count how each exits.

    python benchmarks/exit_stress.py                 # 50 consecutive launches of each script
    python benchmarks/exit_stress.py --runs 10 --only train reduce

A gloo run whose ranks all finished can still die at interpreter exit with `terminate called
without an active exception` (SIGABRT), a race in torch's teardown that `fsdp_offload_cfg.clean_exit`
closes. The rows, each launched on 2 CPU processes (gloo), one launch at a time:

- `train`: `examples/train.py` through `accelerate launch` (ends with `end_training()`);
- `no_end`: a script that loads through the plugin, trains and just ends (no `end_training()`);
- `reduce`: `patch()`, `Accelerator()`, one reduce, exit;
- `plain`: the baseline in the same run, a plain gloo script without the plugin, under torchrun.

Exit status 1 when any launch of a plugin script (every row but `plain`) did not exit 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "benchmarks" / "exit_scripts"
BIN = Path(sys.executable).parent
ABORT_LINE = "terminate called without an active exception"


@dataclass
class Row:
    name: str
    uses_plugin: bool
    command: list[str]
    clean: int = 0
    aborted: int = 0
    other: int = 0
    seconds: list[float] = field(default_factory=list)
    first_failure: str = ""


def build_checkpoint(path: str) -> None:
    from fsdp_offload_cfg.testing.models import save_llama

    save_llama(path)


def rows(config: Path, checkpoint: str) -> list[Row]:
    launch = [str(BIN / "accelerate"), "launch", "--config_file", str(config)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    return [
        Row("train", True, [*launch, str(ROOT / "examples" / "train.py"), "--steps", "2"]),
        Row("no_end", True, [*launch, str(SCRIPTS / "train_without_end_training.py"), checkpoint]),
        Row("reduce", True, [*launch, str(SCRIPTS / "reduce_and_exit.py")]),
        Row("plain", False, [*torchrun, str(SCRIPTS / "plain_gloo.py")]),
    ]


def launch_once(row: Row, env: dict[str, str]) -> None:
    start = time.monotonic()
    proc = subprocess.run(row.command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    row.seconds.append(time.monotonic() - start)
    output = proc.stdout + proc.stderr
    if proc.returncode == 0:
        row.clean += 1
        return
    if ABORT_LINE in output:
        row.aborted += 1
    else:
        row.other += 1
    if not row.first_failure:
        row.first_failure = "\n".join(output.splitlines()[-30:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="consecutive launches per script")
    parser.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "fsdp2_cpu.yaml")
    args = parser.parse_args()

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               FSDP_OFFLOAD_CFG_LOG_LEVEL="WARNING")
    checkpoint = tempfile.mkdtemp(prefix="exit_stress_ckpt_")
    try:
        build_checkpoint(checkpoint)
        selected = [r for r in rows(args.config, checkpoint) if args.only is None or r.name in args.only]
        for row in selected:
            for i in range(args.runs):
                launch_once(row, env)
                print(f"{row.name}: {i + 1}/{args.runs} clean={row.clean} aborted={row.aborted} other={row.other}",
                      file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)

    print(f"\nmachine: {os.cpu_count()} cores; {args.runs} consecutive launches per script, 2 processes each\n")
    print("| script | plugin | launches | exit 0 | aborted at exit | other failure | median s/launch |")
    print("|---|---|---|---|---|---|---|")
    for r in selected:
        print(f"| {r.name} | {'yes' if r.uses_plugin else 'no'} | {len(r.seconds)} | {r.clean} | {r.aborted} | "
              f"{r.other} | {statistics.median(r.seconds):.1f} |")
    for r in selected:
        if r.first_failure and r.uses_plugin:
            print(f"\n--- first failure of {r.name} ---\n{r.first_failure}")
    return 1 if any(r.uses_plugin and r.clean < len(r.seconds) for r in selected) else 0


if __name__ == "__main__":
    sys.exit(main())
