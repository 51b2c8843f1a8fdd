"""Multi-head softmax attention mixer: global causal or sliding-window, RoPE on the whole head or
part of it, grouped-query heads, optional per-head q/k norms and a sigmoid output gate.

For `x: [B, T, d_model]`, `H` query heads and `HKV` key/value heads of width `D = head_dim`:

    q, k, v = x W_q, x W_k, x W_v                 # [B, T, H, D], [B, T, HKV, D], [B, T, HKV, D]
    q, k    = rms_norm(q), rms_norm(k)            # per head, only with `qk_norm`, eps `norm_eps`;
                                                  # scale w, or 1 + w with `zero_centered_norm`
    q, k    = rope(q, t), rope(k, t)              # on the first `r = rotary_dim` channels of each
                                                  # head (default all D), frequencies
                                                  # theta^(-2i/r); channels r..D-1 pass through
    o       = attention(q, k, v, window)          # causal; with `window = w`: t - s < w
    o       = o * sigmoid(x W_g)                  # only with `output_gate`; W_g: [d_model, H * D]
    out     = o W_o                               # o flattened per token to [H * D]

Qwen3-Next's full-attention layers are `qk_norm=True, zero_centered_norm=True, output_gate=True,
rotary_dim=int(head_dim * partial_rotary_factor), norm_eps=rms_norm_eps`. Its `q_proj` emits the
query and the gate together, `[H, 2D]` per token split per head; here `W_q` and `W_g` are separate
projections (`q_proj`, `g_proj`), so a checkpoint converter splits the Hugging Face weight.

Decoding (`init_cache`/`step`, `extend`, `verify`/`accept`) keeps rotated keys and values. Global
attention keeps every position, `[B, max_len, HKV, D]`. Sliding-window attention keeps a ring
buffer of `min(window, max_len)` slots (memory O(window), not O(max_len)). Every row has its own
position (`"pos": [B]`, the number of tokens it has seen, so prompts of different lengths share a
batch) and each slot the absolute position of its key for the mask (`"slot_pos": [B, slots]`;
unwritten slots hold a position no query reaches). Both caches write position `p` to slot
`p % slots`; decoding past `max_len` tokens therefore keeps only the last `max_len` keys (global
attention then behaves as a window of `max_len`). So a query at `p` sees exactly the keys at
positions `(p - slots, p]`: `extend` attends to the cache and the new keys together with that
window and writes only each row's real tokens.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.modules.mixer import Mixer, check_counts, check_trail
from seqlab.modules.norm import RMSNorm
from seqlab.ops import sequence_parallel
from seqlab.ops.attention import attention, rope
from seqlab.ops.checks import check_positive_int

# Position of a cache slot that has never been written: above every query position, so masked.
_UNWRITTEN = jnp.iinfo(jnp.int32).max


class Attention(Mixer):
    """Causal multi-head attention (sliding-window when `window` is set) with rotary embeddings.

    `__call__(x: [B, T, d_model]) -> [B, T, d_model]`; `init_cache(batch_size, max_len)`;
    `step(x_t: [B, d_model], cache) -> (y_t, cache)`, equal to `__call__` token by token;
    `extend(x, cache, lengths=None)`, `verify(x, cache)` and `accept(trail, m)` as in
    `seqlab.modules.mixer` (`verify` takes at most `slots` tokens).

    Attributes:
      d_model: model width.
      num_heads: query heads `H`.
      num_kv_heads: key/value heads `HKV` (None: `H`); fewer than `H`: grouped-query attention.
      head_dim: head width `D` (None: `d_model // H`); even unless `rotary_dim` is set.
      window: None for global causal attention; `w`: each query sees itself and `w - 1` keys.
      rope_theta: RoPE base.
      rotary_dim: None rotates the whole head; an even int `r` in `[2, D]` rotates only the first
        `r` channels of each query and key head (RoPE over width `r`: frequencies
        `theta^(-2i/r)`) and passes the other `D - r` through (Hugging Face's
        `partial_rotary_factor`, `r = int(D * factor)`).
      qk_norm: RMSNorm each query and key head over its `D` channels (params `q_norm`, `k_norm`).
      norm_eps: epsilon of the q/k norms.
      zero_centered_norm: the q/k norms scale by `1 + weight`, `weight` initialized to zeros
        (`RMSNorm(zero_centered=True)`); requires `qk_norm`.
      output_gate: multiply the attention output, per head channel before `o_proj`, by
        `sigmoid(g_proj(x))` with `g_proj: d_model -> H * D`, no bias (gated attention).
      dtype: compute dtype; param_dtype: parameter dtype.
      seq_axis: the mesh axis the time axis is split over when the module runs inside
        `shard_map` (sequence parallelism); None: the whole sequence is local. Positions (RoPE,
        the causal mask and the window) are then global. Decoding ignores it.
    """

    d_model: int
    num_heads: int
    num_kv_heads: int | None = None  # None: num_heads (multi-head); fewer: grouped-query
    head_dim: int | None = None  # None: d_model // num_heads
    window: int | None = None  # None: global causal; w: each query sees itself and w - 1 keys
    rope_theta: float = 10000.0
    qk_norm: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    output_gate: bool = False  # o *= sigmoid(g_proj(x)) per head channel, before o_proj
    rotary_dim: int | None = None  # None: rotate the whole head; r: only its first r channels
    norm_eps: float = 1e-6  # epsilon of q_norm / k_norm
    zero_centered_norm: bool = False  # q_norm / k_norm scale by 1 + weight (weight init 0)
    seq_axis: str | None = None  # the mesh axis splitting time inside shard_map; None: local

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_size(self) -> int:
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    def check_fields(self) -> None:
        check_positive_int("d_model", self.d_model)
        check_positive_int("num_heads", self.num_heads)
        check_positive_int("num_kv_heads", self.kv_heads)
        check_positive_int("head_dim", self.head_size)
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_kv_heads must divide num_heads = {self.num_heads}, got {self.kv_heads}"
            )
        if self.rotary_dim is None:
            if self.head_size % 2:
                raise ValueError(f"head_dim must be even for RoPE, got {self.head_size}")
        else:
            check_positive_int("rotary_dim", self.rotary_dim)
            if self.rotary_dim % 2 or self.rotary_dim > self.head_size:
                raise ValueError(
                    f"rotary_dim must be an even int in [2, head_dim = {self.head_size}], "
                    f"got {self.rotary_dim}"
                )
        if self.window is not None:
            check_positive_int("window", self.window)
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if self.zero_centered_norm and not self.qk_norm:
            raise ValueError("zero_centered_norm requires qk_norm=True (it sets the q/k norms)")

    def setup(self):
        def dense(features: int, name: str) -> nn.Dense:
            return nn.Dense(
                features,
                use_bias=False,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=name,
            )

        self.q_proj = dense(self.num_heads * self.head_size, "q_proj")
        self.k_proj = dense(self.kv_heads * self.head_size, "k_proj")
        self.v_proj = dense(self.kv_heads * self.head_size, "v_proj")
        self.o_proj = dense(self.d_model, "o_proj")
        if self.output_gate:
            self.g_proj = dense(self.num_heads * self.head_size, "g_proj")
        if self.qk_norm:
            norm = dict(
                eps=self.norm_eps,
                zero_centered=self.zero_centered_norm,
                param_dtype=self.param_dtype,
            )
            self.q_norm = RMSNorm(**norm)
            self.k_norm = RMSNorm(**norm)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on the first `rotary_dim` channels of each head of `x: [B, T, heads, D]`."""
        return rope(x, positions, theta=self.rope_theta, rotary_dim=self.rotary_dim)

    def _qkv(self, x: jax.Array, positions: jax.Array):
        """Project `x: [B, T, d_model]` to rotated `q: [B, T, H, D]` and `k, v: [B, T, HKV, D]`."""
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, self.num_heads, self.head_size)
        k = self.k_proj(x).reshape(batch, length, self.kv_heads, self.head_size)
        v = self.v_proj(x).reshape(batch, length, self.kv_heads, self.head_size)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self._rope(q, positions), self._rope(k, positions), v

    def _out(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """`o: [B, T, H, D]`, the layer input `x: [B, T, d_model]` (for the output gate) ->
        `[B, T, d_model]`."""
        o = o.reshape(*o.shape[:2], self.num_heads * self.head_size)
        if self.output_gate:
            acc = self.acc_dtype
            gate = jax.nn.sigmoid(self.g_proj(x).astype(acc))
            o = (o.astype(acc) * gate).astype(self.dtype)
        return self.o_proj(o)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, d_model]` -> `[B, T, d_model]`."""
        inputs = self.op_inputs(x)
        if self.seq_axis is None:
            return self._out(attention(**inputs), x)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        o = sequence_parallel.attention(q, k, v, axis_name=self.seq_axis, window=self.window)
        return self._out(o, x)

    def op_inputs(self, x: jax.Array) -> dict:
        """The operands of `seqlab.ops.attention` for `x: [B, T, d_model]`, as `__call__` passes
        them: `{"q": [B, T, H, D], "k", "v": [B, T, HKV, D]` (q and k rotated), `"q_positions",
        "k_positions": [T] int32, "window"}`. With `seq_axis`, `x` is this device's piece of
        the sequence and the positions are global: `axis_index(seq_axis) T + arange(T)`."""
        self.check_sequence(x)
        positions = jnp.arange(x.shape[1], dtype=jnp.int32)
        if self.seq_axis is not None:
            positions = positions + jax.lax.axis_index(self.seq_axis) * x.shape[1]
        q, k, v = self._qkv(x, positions)
        return dict(q=q, k=k, v=v, q_positions=positions, k_positions=positions, window=self.window)

    def zero_cache(self, batch_size: int, max_len: int) -> dict:
        """`{"k", "v": [B, slots, HKV, D] in dtype, "slot_pos": [B, slots] int32` (all unwritten),
        `"pos": [B] int32` (zeros)} with `slots = max_len` (global) or `min(window, max_len)`
        (sliding window).
        """
        slots = max_len if self.window is None else min(self.window, max_len)
        shape = (batch_size, slots, self.kv_heads, self.head_size)
        return {
            "k": jnp.zeros(shape, self.dtype),
            "v": jnp.zeros(shape, self.dtype),
            "slot_pos": jnp.full((batch_size, slots), _UNWRITTEN, jnp.int32),
            "pos": jnp.zeros((batch_size,), jnp.int32),
        }

    def step(self, x_t: jax.Array, cache: dict):
        """One decoding step: `x_t: [B, d_model]` -> (`y_t: [B, d_model]`, updated cache)."""
        self.check_token(x_t)
        pos = cache["pos"]  # [B]
        q, k, v = self._qkv(x_t[:, None], pos[:, None])  # [B, 1, H or HKV, D]
        rows, slot = jnp.arange(pos.shape[0]), pos % cache["k"].shape[1]  # each row's slot
        new_cache = {
            "k": cache["k"].at[rows, slot].set(k[:, 0].astype(cache["k"].dtype)),
            "v": cache["v"].at[rows, slot].set(v[:, 0].astype(cache["v"].dtype)),
            "slot_pos": cache["slot_pos"].at[rows, slot].set(pos),
            "pos": pos + 1,
        }
        o = attention(
            q,
            new_cache["k"],
            new_cache["v"],
            q_positions=pos[:, None],
            k_positions=new_cache["slot_pos"],
            window=self.window,
        )
        return self._out(o, x_t[:, None])[:, 0], new_cache

    def extend(self, x: jax.Array, cache: dict, lengths=None) -> tuple[jax.Array, dict]:
        """`x: [B, T, d_model]` continuing from `cache`, row `b`'s first `lengths[b]` tokens real:
        `(y: [B, T, d_model], cache after the real tokens)` (see `seqlab.modules.mixer`).

        Row `b`'s token `t` is at position `pos[b] + t` and attends to the cached keys and the new
        ones at positions `(pos[b] + t - slots, pos[b] + t]`, the keys `step` would hold; pad keys
        lie after every real query, and only real tokens are written.
        """
        lengths, _ = self.check_extend(x, lengths)
        positions = cache["pos"][:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)  # [B, T]
        q, k, v = self._qkv(x, positions)
        o = attention(
            q,
            jnp.concatenate([cache["k"], k.astype(cache["k"].dtype)], axis=1),
            jnp.concatenate([cache["v"], v.astype(cache["v"].dtype)], axis=1),
            q_positions=positions,
            k_positions=jnp.concatenate([cache["slot_pos"], positions], axis=1),
            window=cache["k"].shape[1],
        )
        return self._out(o, x), _write(cache, k, v, lengths)

    def verify(self, x: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """Run `n <= slots` (draft) tokens `x: [B, n, d_model]` from `cache`: `(y: [B, n,
        d_model], trail)`, `y` equal to `step` token by token, `trail = {"cache": the cache after
        all n tokens, "old": {"k", "v", "slot_pos"}: the previous contents of the n slots they
        overwrote, [B, n, ...]}`."""
        self.check_sequence(x)
        slots = cache["k"].shape[1]
        if x.shape[1] > slots:
            raise ValueError(
                f"x must hold at most {slots} tokens (the cache's slots) to verify, "
                f"got shape {x.shape}"
            )
        y, new_cache = self.extend(x, cache)
        index = _slots(cache["pos"], x.shape[1], slots)
        old = {name: _take(cache[name], index) for name in ("k", "v", "slot_pos")}
        return y, {"cache": new_cache, "old": old}

    def accept(self, trail: dict, m: jax.Array) -> dict:
        """The cache after each row's first `m[b]` tokens (`m: [B]` int in `[0, n]`) of the
        `verify` that made `trail`: its slots of the rejected tokens get their old contents back."""
        check_trail(trail, ("cache", "old"))
        cache, old = trail["cache"], trail["old"]
        m = check_counts("m", m, cache["pos"].shape[0])
        n = old["k"].shape[1]
        start = cache["pos"] - n
        index = _slots(start, n, cache["k"].shape[1])  # [B, n], distinct per row
        rejected = jnp.arange(n) >= m[:, None]  # [B, n]
        rows = jnp.arange(index.shape[0])[:, None]
        restored = {"pos": start + m}
        for name in ("k", "v", "slot_pos"):
            mask = rejected.reshape(rejected.shape + (1,) * (old[name].ndim - 2))
            kept = jnp.where(mask, old[name], _take(cache[name], index))
            restored[name] = cache[name].at[rows, index].set(kept)
        return restored


def _slots(start: jax.Array, n: int, slots: int) -> jax.Array:
    """The slots of positions `start[b] + i`, `i < n`: `[B, n]` int32."""
    return (start[:, None] + jnp.arange(n, dtype=jnp.int32)) % slots


def _take(a: jax.Array, index: jax.Array) -> jax.Array:
    """`a[b, index[b, i]]` for `a: [B, slots, ...]`, `index: [B, n]` -> `[B, n, ...]`."""
    return jax.vmap(lambda row, i: row[i])(a, index)


def _write(cache: dict, k: jax.Array, v: jax.Array, lengths: jax.Array) -> dict:
    """The cache after writing row `b`'s first `lengths[b]` keys and values `k, v: [B, T, HKV, D]`
    at positions `pos[b] + t`, slot `(pos[b] + t) % slots`.

    Slot `s` ends up holding the newest written position congruent to `s`,
    `p = last - (last - s) mod slots` with `last = pos + lengths - 1`, when `p >= pos`, and keeps
    its old contents otherwise (so `T` may exceed the slots, and `lengths[b] = 0` writes nothing).
    """
    slots = cache["k"].shape[1]
    pos = cache["pos"][:, None]  # [B, 1]
    last = pos + lengths[:, None] - 1
    newest = last - (last - jnp.arange(slots, dtype=jnp.int32)) % slots  # [B, slots]
    written = newest >= pos
    index = jnp.clip(newest - pos, 0, k.shape[1] - 1)  # token of each slot, where written
    out = {"slot_pos": jnp.where(written, newest, cache["slot_pos"]), "pos": cache["pos"] + lengths}
    for name, new in (("k", k), ("v", v)):
        out[name] = jnp.where(
            written[..., None, None], _take(new.astype(cache[name].dtype), index), cache[name]
        )
    return out
