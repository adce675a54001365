"""Calibration tools: what the selector's counts are checked against or priced by, not
benchmarks a user runs. The machine constants (`machine`), the memory model on small
compiled programs (`calibrate`, `memory_holdout`), the whole-step judge sets compiled by
MaxText and by this project (`maxtext_step`, `step_compile`), the margin read from them
(`margins`), and the compiler temp no buffer names (`libtpu_temp`, read from XLA dumps
by `dump_peak`), and XLA:TPU's bytes for the real layers gathered against exchanged
(`exchange_bytes`). Each writes JSON under bench/results/; the library reads none of it."""
