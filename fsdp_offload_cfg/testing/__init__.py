"""The project's test kit: what its tests, benchmarks and the GPU session scripts share, so each
of them imports it by name instead of editing `sys.path` (as `accelerate.test_utils` ships with
accelerate). Not part of the public API; nothing in the package imports it.

- `dist`: run a function on N real gloo ranks (`run_workers`), no mocked process group;
- `models`: tiny Hugging Face models built from configs and saved locally (no hub);
- `clients`: the tiny Llama and word tokenizer the framework CLIs (LlamaFactory, ms-swift,
  axolotl) train on, with nothing imported that an older transformers lacks;
- `offload_models`, `real_runs`: small models and the real measurements the offload and the
  estimate are checked against;
- `compare`, `reads`, `configs`, `cli_budget`: digests for bit-equality across processes, the
  kernel's count of bytes read, the loader configs, the framework-CLI budget checks.
- `host_memory`: a benchmark launch stopped whole before the host runs out of memory.
"""
