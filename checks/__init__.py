"""The checks that need a compiler: compile mode (`compile=true`, `checks.compile_mode`)
and measure mode (`measure=true`, `checks.measure_mode`).

They import the selector and the layers; neither imports them. The selector finds them
by the `moe_cp.checks` entry points that pyproject.toml declares (`selector.plugins`),
so `selector.compile_check`, `selector.measure_check`, the CLI and the OmegaConf
resolver reach them. Importing this package imports no jax: the modes import it when
they compile or time, after the process is set up for the target.
"""
