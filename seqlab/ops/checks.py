"""Argument checks shared by the library: every error names the argument and what was expected.

Checks run on static shapes and dtypes only, so they cost nothing under `jit` and fire before any
heavy work is traced. `accumulation_dtype` is the one rule for the dtype of states, gates, solves
and exponentials (DESIGN.md section 2).
"""

from collections.abc import Sequence

import jax.numpy as jnp


def check_floating(name: str, x) -> None:
    """Raise `ValueError` unless `x` is a floating-point array."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}")


def check_shape(name: str, x, expected: Sequence[int | None], layout: str) -> None:
    """Raise `ValueError` unless `x.shape` matches `expected` (None matches any size).

    `layout` names the axes for the message, e.g. "[B, T, H, K]".
    """
    shape = tuple(jnp.shape(x))
    if len(shape) != len(expected):
        raise ValueError(
            f"{name} must have rank {len(expected)} with layout {layout}, got shape {shape}"
        )
    for got, want in zip(shape, expected, strict=True):
        if want is not None and got != want:
            want_str = "[" + ", ".join("*" if w is None else str(w) for w in expected) + "]"
            raise ValueError(f"{name} must have shape {layout} = {want_str}, got {shape}")


def check_choice(name: str, value, choices: Sequence) -> None:
    """Raise `ValueError` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_positive_int(name: str, value) -> None:
    """Raise `ValueError` unless `value` is a positive Python int."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def accumulation_dtype(*xs) -> jnp.dtype:
    """float32, or float64 when an input is float64: the dtype of states, gates and solves.

    `xs` are arrays or dtypes; `None` entries (absent optional arguments) are skipped.
    """
    present = [jnp.result_type(x) for x in xs if x is not None]
    return jnp.promote_types(jnp.result_type(*present), jnp.float32)
