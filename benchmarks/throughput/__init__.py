"""`benchmarks/train_throughput.py`'s parts, by mode family: `common` (presets, data, batches), `bench` (the timed
loop every mode shares), `peer_modes` (A, B, C, Cl, Cn, Lp and their variants), `sftflow_modes` (D and its
variants, L, Q), `profiling`, `report` and `run` (the command line)."""
