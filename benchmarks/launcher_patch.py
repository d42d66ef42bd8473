"""What `patch()` costs a process that loads no model: a framework's launcher under `fsdp-offload-cfg run`.

Usage: python benchmarks/launcher_patch.py [--repeat N] [--checkout DIR ...]
       (on an otherwise idle machine; `--checkout` adds the rows of another checkout of this
       project, e.g. `git worktree add /tmp/before 6aaedbd` for the code before the models'
       patches went lazy)

Under `fsdp-offload-cfg run` the autopatch switch and the `_bootstrap` folder are inherited by
every Python process the command starts, and `patch()` runs first thing in each: the ranks, and
also the front ends that only start them (`swift sft`, `llamafactory-cli`, `trl sft` running
accelerate's launcher in its own process). Those never build a model, so whatever `patch()`
imports there is paid once per launch for nothing. Each row here is a fresh interpreter that
imports what such a front end imports (torchrun's module, or accelerate's launcher) and exits,
started the way `fsdp-offload-cfg run` starts it (the switch on, `_bootstrap` first on
`PYTHONPATH`, the config named by `FSDP_OFFLOAD_CFG`) or without the plugin. `WORLD_SIZE=2`
and `LOCAL_RANK=0` are set in both, so `patch()` plans what a rank's would (the most it does).

CPU-seconds are the child's user + system time as the kernel reports it to its parent (the
growth of `getrusage(RUSAGE_CHILDREN)` across the child, which it starts no process of), not anything the plugin measures; "imported" lists which of the heavy modules a
launcher has no use for the child ended up holding (transformers' models, dynamo, FSDP2).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = {"torchrun": "torch.distributed.run", "accelerate launch": "accelerate.commands.launch"}
HEAVY = {"modeling_utils": "transformers.modeling_utils", "dynamo": "torch._dynamo",
         "FSDP2": "torch.distributed.fsdp._fully_shard"}
CONFIG = """\
distributed_type: FSDP
num_processes: 2
fsdp_config:
  fsdp_version: 2
  fsdp_cpu_ram_efficient_loading: true
  fsdp_activation_cpu_offload: true
  fsdp_activation_memory_budget: 4GiB
"""
# the child: import the launcher's module, then say what it holds (json on its last line)
CHILD = """
import importlib, json, sys
importlib.import_module({module!r})
plugin = sys.modules.get("fsdp_offload_cfg")
print(json.dumps({{"patched": plugin is not None and plugin.active_config() is not None,
                  "modules": len(sys.modules), "heavy": [k for k, m in {heavy!r}.items() if m in sys.modules]}}))
"""


def run_once(module: str, checkout: Path | None, config: Path) -> dict:
    """One fresh interpreter importing `module`, with the plugin of `checkout` switched on (None: off)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FSDP_OFFLOAD_CFG", "ACCELERATE_", "PYTHONPATH"))}
    env.update(WORLD_SIZE="2", LOCAL_RANK="0", RANK="0")
    if checkout is not None:
        bootstrap = checkout / "fsdp_offload_cfg" / "_bootstrap"
        env.update(FSDP_OFFLOAD_CFG_AUTOPATCH="1", FSDP_OFFLOAD_CFG=str(config),
                   PYTHONPATH=os.pathsep.join([str(bootstrap), str(checkout)]))
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD.format(module=module, heavy=HEAVY)], env=env,
                          capture_output=True, text=True)
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    out, err = proc.stdout, proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"the child importing {module} ({'plugin from ' + str(checkout) if checkout else 'no plugin'}) "
                         f"exited {proc.returncode}:\n{err[-3000:]}")
    facts = json.loads(out.strip().splitlines()[-1])
    if facts["patched"] != (checkout is not None):
        raise SystemExit(f"the child importing {module} was {'not ' if checkout else ''}patched; stderr:\n{err[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**facts, "cpu": cpu, "wall": wall}


def measure(checkouts: list[Path], repeat: int) -> list[dict]:
    """Every (entry, plugin) row `repeat` times, the rows interleaved so a slow spell hits them all."""
    rows = [{"entry": entry, "module": module, "checkout": checkout, "runs": []}
            for entry, module in ENTRIES.items() for checkout in [None, *checkouts]]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "fsdp2.yaml"
        config.write_text(CONFIG)
        for _ in range(repeat):
            for row in rows:
                row["runs"].append(run_once(row["module"], row["checkout"], config))
                print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| process | plugin | CPU-s (min-max) | median | wall s (median) | modules | imported |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        cpu = [r["cpu"] for r in row["runs"]]
        plugin = "none" if row["checkout"] is None else f"`patch()` from {_name(row['checkout'])}"
        heavy = ", ".join(row["runs"][-1]["heavy"]) or "none of them"
        lines.append(f"| {row['entry']} | {plugin} | {min(cpu):.2f}-{max(cpu):.2f} | {statistics.median(cpu):.2f} | "
                     f"{statistics.median(r['wall'] for r in row['runs']):.2f} | {row['runs'][-1]['modules']} | {heavy} |")
    return "\n".join(lines)


def _name(checkout: Path) -> str:
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return f"`{commit}`" if commit else str(checkout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row (default 3)")
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="another checkout of this project to measure beside this one")
    args = parser.parse_args(argv)
    rows = measure([ROOT, *(c.resolve() for c in args.checkout)], args.repeat)
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {args.repeat} runs a row; "
          "CPU-s: the child's user + system time (RUSAGE_CHILDREN)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
