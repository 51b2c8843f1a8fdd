"""The contract every sequence mixer implements (Mamba, Mamba2, GatedDeltaNet, Attention).

A mixer maps `x: [B, T, d_model] -> [B, T, d_model]` causally and can decode token by token:

    __call__(x)                    the layer on a whole sequence
    op_inputs(x) -> dict           the keyword arguments it feeds its op (`selective_scan`, `ssd`,
                                   `gated_delta_rule`, `attention`), as `__call__` passes them, for
                                   measurements that need the op's operands
    init_cache(batch_size, max_len) -> dict   the zero decoding cache; a recurrent state is under
                                   `"state"`, convolution inputs under `"conv"` (or `"<x>_conv"`)
    step(x_t, cache) -> (y_t, cache)          one token, `x_t: [B, d_model]`; equal to `__call__`
                                   token by token

Fields are validated when the mixer is constructed (`check_fields`), so a bad size fails before any
tracing; inputs are checked by `check_sequence` / `check_token` before any heavy work.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.ops.checks import accumulation_dtype, check_floating, check_positive_int, check_shape


class Mixer(nn.Module):
    """Base of the sequence mixers: field validation at construction and the shared input checks.

    Subclasses declare the fields `d_model` and `dtype` and implement `check_fields()` (raise
    `ValueError` naming the first bad field), `op_inputs`, `__call__`, `zero_cache(batch_size,
    max_len)` (the cache `init_cache` returns once the sizes are checked) and `step`.
    """

    def __post_init__(self):
        self.check_fields()
        super().__post_init__()

    @property
    def acc_dtype(self) -> jnp.dtype:
        """States, gates and decays: float32, or float64 for a float64 compute dtype."""
        return accumulation_dtype(self.dtype)

    def check_sequence(self, x: jax.Array) -> None:
        """`x` must be a floating `[B, T, d_model]` array."""
        check_floating("x", x)
        check_shape("x", x, (None, None, self.d_model), "[B, T, d_model]")

    def check_token(self, x_t: jax.Array) -> None:
        """`x_t` must be a floating `[B, d_model]` array."""
        check_floating("x_t", x_t)
        check_shape("x_t", x_t, (None, self.d_model), "[B, d_model]")

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """The zero decoding cache for `batch_size` sequences of up to `max_len` tokens (recurrent
        mixers ignore `max_len`: their cache does not grow)."""
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_len", max_len)
        return self.zero_cache(batch_size, max_len)


def check_dt_init(dt_min: float, dt_max: float, dt_init_floor: float) -> None:
    """The range of the initial step sizes of the Mamba-style mixers: `0 < dt_min <= dt_max`,
    `dt_init_floor >= 0`."""
    if not 0 < dt_min <= dt_max:
        raise ValueError(
            "dt_min, dt_max must satisfy 0 < dt_min <= dt_max, "
            f"got dt_min={dt_min}, dt_max={dt_max}"
        )
    if dt_init_floor < 0:
        raise ValueError(f"dt_init_floor must be >= 0, got {dt_init_floor}")
