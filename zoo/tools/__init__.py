"""Tooling around the core, not part of it: `zoo bench` and its workers, the side-by-side
benchmarks (bench_ad, bench_checkpointing), the PyTorch reference model that the benchmark and
the parity tests share (torch_reference), and the model-card generator (`zoo card`, `zoo cards`).
The core never imports from here; the command line does, inside the verbs that use it."""
