"""Experiment configs: `get_config(arg)` per file, the exact launch command in its docstring."""
