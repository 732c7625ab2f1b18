"""Weights held as integers and per-group scales, and the products that read them.

A `QuantizedWeight` stands where a float matrix stood in the params pytree (`wqkv`,
`wo`, `w_gate_up`, `w_down`, `embed`, `lm_head`; a stacked layer's have one leading
axis more). Its value is `q * scale + offset`, group by group along the axis the
products contract (`axis`: -2 for a `[D, F]` weight, -1 for the `[V, D]` embedding,
contracted by the tied head)::

    weight [D, F], group g = D / G, axis = -2
    q       int8 or int4 [D, F]     rows 0..g-1 | g..2g-1 | ... | D-g..D-1
    scale   float        [G, F]     row 0       | row 1   | ... | row G-1
    offset  float        [G, F]     as scale, or None (symmetric: value = q * scale)

    the scales and offsets: bfloat16 for groups (G > 1), float32 for one (int8); GGUF's
    blocks float32 (their 16-bit scales times 6-bit sub-block ones do not fit 16 bits)

    int8 (`quantize(w, 8)`): one group (G = 1), a scale per output column
    int4 (`quantize(w, 4, group, offsets=True)`): groups of `group` inputs, values in
      [-8, 7] first spanning each group's [min, max], then fit to its weights by least
      squares (`quantize="int4"`; symmetric without offsets)
    GGUF blocks (`mdjax.checkpoints.gguf_native`): groups of 16 or 32, as ggml keeps
      them; the asymmetric types (Q4_1, Q5_1, Q4_K, Q5_K) with an offset

No float copy of the weight is built to compute a product (`product`):

- on CPU the activations are written as two int8 terms per row and group, `x ~ s1 a1 + s2 a2`
  (`s1 = max|x| / 127`, `a2` the rounded remainder at 1/254 of that step: an error of at
  most `max|x| / 64516` per element), stacked as rows of one integer product with q,
  accumulated in int32 per group, then scaled: XLA:CPU multiplies int8 by int8 at 2-3x
  its float32 speed, while converting a weight to float every step costs more than the
  float32 product itself (docs/benchmarks/quantized.md). int4 values are held one per
  byte on CPU (XLA:CPU reads int4 through a conversion);
- on a GPU or TPU q is converted to the activations' dtype inside the product's operand
  (XLA fuses the conversion and the group scale into the product: the program report
  finds no dequantized weight among a step's temporaries); one group per column (int8)
  takes the scale on the product's float32 output instead, exactly `x @ (q * scale)`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mdjax import platform
from mdjax.errors import MdjaxError

# int4: groups of `INT4_GROUP` inputs unless told, each spanning its own [min, max] (an
# offset), the embedding and an untied head int8: the better perplexity in each pair
# measured on SmolLM2 and Gemma 3 (docs/quantization.md). Groups of 32 scored better
# still on these models, but compiled for a v5e XLA copied every layer's int4 weights at
# every step (3.7 GiB at the 1B shape): a TPU's int4 tiles are wider than such a group.
INT4_GROUP = 64
INT4_KEEPS_INT8 = ("embed", "lm_head")
# Groups' scales and offsets are held in bfloat16 (GGUF's blocks keep theirs in 16 bits
# too): at groups of 64 float32 ones were a fifth of an int4 weight's bytes. A column's
# one scale (int8) stays float32, a few bytes per column.
GROUP_SCALE_DTYPE = jnp.bfloat16
# Least-squares fits of each group's grid after the min-max one (`quantize`). Perplexity
# of SmolLM2 / Gemma 3 at int4 (groups of 64 with offsets, an int8 embedding), 105.7 /
# 107.1 with none, 96.1 / 101.5 with 6 (`experiments.bench.int4_groups --groups=64
# --refits=N`, docs/quantization.md); SmolLM2 101.2, 98.8 and 96.7 with 1, 3 and 12.
GROUP_REFITS = 6
SCHEMES = ("int8", "int4")  # `mdjax.load(..., quantize=...)` besides "gguf"
STEP = 127.0  # the largest int8 magnitude an activation term takes
REMAINDER_STEPS = 254.0  # the second term's step: the first's / 254 (its remainder <= half)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale", "offset"],
                   meta_fields=["axis", "bits", "dtype"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  q: Int[Array, "... D F"]  # int8 or int4 (int4 values held as int8 on CPU)
  scale: Float[Array, "... G F"]  # bfloat16 or float32 (module); for axis=-1: [..., V, G]
  offset: Float[Array, "... G F"] | None  # as scale, or None
  axis: int  # the contracted axis, along which the groups run: -2 ([D, F]) or -1 ([V, D])
  bits: int  # the values' width: 8, or 4, 5, 6 (GGUF blocks); 4 is held as int4 off CPU
  dtype: np.dtype  # the activations' dtype (the model's): what a float weight's dtype was

  @property
  def shape(self) -> tuple[int, ...]:
    return self.q.shape

  @property
  def ndim(self) -> int:
    return self.q.ndim

  @property
  def group(self) -> int:
    return self.q.shape[self.axis] // self.scale.shape[self.axis]

  @property
  def nbytes(self) -> int:
    """The bytes a product reads: q as it is held, the scales and offsets."""
    values = self.q.size * (4 if self.q.dtype == jnp.int4 else 8) // 8
    return values + self.scale.nbytes + (0 if self.offset is None else self.offset.nbytes)


def is_quantized(weight) -> bool:
  return isinstance(weight, QuantizedWeight)


def same_form(weights: list) -> bool:
  """Whether `weights`, the parts of one projection (`[D, F_i]` each), can be held as one
  (`concatenate`): all float, or all quantized along one axis with one group size and
  one offset form (a GGUF file may mix float matrices and blocks of several types)."""
  return len({(w.axis, w.group, w.offset is None) if is_quantized(w) else None
              for w in weights}) == 1


def concatenate(weights: list, xp=jnp):
  """`weights` of one form (`same_form`), `[D, F_i]` each, as one `[D, sum F_i]`: a float
  matrix, or a quantized weight whose q is held for the widest part's bits. `xp`:
  jax.numpy, or `mdjax.checkpoints.lazy` for recipes read later by slices."""
  if not is_quantized(weights[0]):
    return xp.concatenate(weights, axis=-1)
  bits = max(w.bits for w in weights)

  def joined(field: str, dtype=None):
    return xp.concatenate([xp.asarray(getattr(w, field), dtype) for w in weights], axis=-1)

  return dataclasses.replace(
      weights[0], q=joined("q", held_bits_dtype(bits)), scale=joined("scale"),
      offset=None if weights[0].offset is None else joined("offset"), bits=bits)


def splits(weight, parts: int) -> bool:
  """Whether `weight`'s product comes in `parts` parts over D (`numerics.linear_parts`):
  a float matrix; a quantized `[D, F]` one whose groups fall into them (a multiple of
  `parts`, or one group without offsets: `product_parts`)."""
  if not is_quantized(weight):
    return True
  groups = weight.scale.shape[-2]
  return weight.axis == -2 and (groups % parts == 0 or (groups == 1 and weight.offset is None))


def product_parts(rows: Float[Array, "M D"], weight: QuantizedWeight, parts: int
                  ) -> Float[Array, "P M F"]:
  """`rows @ value(weight)` as `parts` float32 partial products over slices of D, each
  scaled (the GPU's path: `numerics.linear_parts`, which an attention kernel adds)."""
  dtype = jnp.dtype(weight.dtype)
  m, d = rows.shape
  groups = weight.scale.shape[-2]
  per = max(groups, parts)  # products batched over `per` slices of D
  contract = (((2,), (1,)), ((1,), (0,)))  # MPd,PdF->PMF
  sums = jax.lax.dot_general(rows.astype(dtype).reshape(m, per, d // per),
                             weight.q.astype(dtype).reshape(per, d // per, -1), contract,
                             preferred_element_type=jnp.float32)  # [per, M, F]
  scale = weight.scale if groups == per else jnp.broadcast_to(weight.scale, (per, sums.shape[-1]))
  scaled = sums * scale[:, None, :]
  if weight.offset is not None:  # groups == per: each group's inputs' sum times its offsets
    sums_x = rows.astype(jnp.float32).reshape(m, per, d // per).sum(-1)  # [M, per]
    scaled = scaled + sums_x.T[:, :, None] * weight.offset[:, None, :]
  return scaled.reshape(parts, per // parts, m, -1).sum(1)  # [P, M, F]


def take_rows(embedding, ids: Int[Array, "..."]) -> Float[Array, "... D"]:
  """Rows `ids` of an embedding `[V, D]`, float or quantized (groups along D), as floats
  of its dtype: `embedding[ids]`."""
  if not is_quantized(embedding):
    return embedding[ids]
  value = embedding.q[ids].astype(jnp.float32) * _expand(embedding.scale[ids], embedding)
  if embedding.offset is not None:
    value = value + _expand(embedding.offset[ids], embedding)
  return value.astype(embedding.dtype)


def take_columns(matrix, ids: Int[Array, "C"]) -> Float[Array, "D C"]:
  """Columns `ids` of a `[D, V]` matrix, float or quantized (groups along D), as floats
  of its dtype: `matrix[:, ids]`."""
  if not is_quantized(matrix):
    return jnp.take(matrix, ids, axis=1)
  picked = dataclasses.replace(matrix, q=jnp.take(matrix.q, ids, axis=-1),
                               scale=jnp.take(matrix.scale, ids, axis=-1),
                               offset=None if matrix.offset is None else
                               jnp.take(matrix.offset, ids, axis=-1))
  return dequantize(picked).astype(matrix.dtype)


def held_bits_dtype(bits: int):
  """The integer dtype q is held in: int4 on a GPU or TPU, int8 on CPU (see the module)."""
  return jnp.int4 if bits == 4 and not platform.is_cpu() else jnp.int8


def from_parts(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, *, axis: int,
               bits: int, dtype, xp=jnp) -> QuantizedWeight:
  """A `QuantizedWeight` from host arrays (a checkpoint's blocks), q in the dtype this
  platform holds `bits`-bit values in: on the default device (`xp` jax.numpy), or kept
  on the host (`xp` numpy: for `mdjax.sharding.WeightPlacement.place` to put on a mesh)."""
  return QuantizedWeight(q=xp.asarray(q, held_bits_dtype(bits)), scale=xp.asarray(scale),
                         offset=None if offset is None else xp.asarray(offset), axis=axis,
                         bits=bits, dtype=jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("bits", "group", "axis", "offsets", "refits"))
def quantize(weight: Float[Array, "... A B"], bits: int, group: int | None = None, *,
             axis: int = -2, offsets: bool = False, refits: int = GROUP_REFITS
             ) -> QuantizedWeight:
  """`weight` as integers of `bits` (8 or 4): int8 one group per output (`group` None),
  int4 in groups of `group` along `axis`. Symmetric by default (absmax scales, value =
  q * scale); with `offsets`, each group's 2^bits levels span its own [min, max] (value
  = q * scale + offset, q from -2^(bits-1)), as GGUF's Q4_1 blocks do.

  Groups (more than one) are then fit `refits` times: each group's scale (and offset)
  becomes the least-squares fit of its weights on the levels they took, and the levels
  are chosen again on that grid. Each fit lowers the squared error the min-max grid left
  (a grid no longer stretched to the group's outliers); it reads the weights alone, no
  data. q is always chosen on the grid of the scale and offset as held (bfloat16)."""
  size = weight.shape[axis]
  group = size if group is None else group
  if size % group:
    raise MdjaxError(f"quantize group={group} does not divide the weight's input dimension "
                     f"{size} (shape {tuple(weight.shape)}); pick a divisor of {size}")
  w = jnp.asarray(weight, jnp.float32)
  grouped = _split_groups(w, axis, group)  # [..., G, g, B] or [..., A, G, g]
  inner = -1 if axis == -1 else -2  # the g axis of `grouped`
  half = 2.0 ** (bits - 1)  # q in [-half, half - 1]
  held = GROUP_SCALE_DTYPE if group < size else jnp.float32

  def rounded(a):  # as held: q is chosen on the grid the held scale and offset draw
    return a.astype(held).astype(jnp.float32)

  def levels(scale, offset):
    return jnp.clip(jnp.round((grouped - offset) / scale), -half, half - 1)

  if offsets:
    low = jnp.min(grouped, axis=inner, keepdims=True)
    scale = (jnp.max(grouped, axis=inner, keepdims=True) - low) / (2 * half - 1)
    scale = rounded(jnp.where(scale == 0, 1.0, scale))
    offset = rounded(low + half * scale)
  else:
    scale = jnp.max(jnp.abs(grouped), axis=inner, keepdims=True) / (half - 1)
    scale = rounded(jnp.where(scale == 0, 1.0, scale))
    offset = jnp.zeros_like(scale)
  q = levels(scale, offset)
  for _ in range(refits if group < size else 0):
    scale, offset = (rounded(a) for a in _least_squares(grouped, q, scale, offset, inner,
                                                         offsets))
    q = levels(scale, offset)
  return QuantizedWeight(q=q.reshape(w.shape).astype(held_bits_dtype(bits)),
                         scale=jnp.squeeze(scale, inner).astype(held),
                         offset=jnp.squeeze(offset, inner).astype(held) if offsets else None,
                         axis=axis, bits=bits, dtype=jnp.dtype(weight.dtype))


def _least_squares(w: Array, q: Array, scale: Array, offset: Array, inner: int, offsets: bool
                   ) -> tuple[Array, Array]:
  """Per group (reduced along `inner`), the scale (and offset) that minimise
  `sum (q * scale + offset - w)^2` for the levels `q`; where the levels cannot fix one
  (a group of one level, or a fit that would turn the scale to 0 or below), the
  group's `scale` and `offset` as they were."""
  def mean(a):
    return jnp.mean(a, axis=inner, keepdims=True)

  if offsets:
    mq, mw = mean(q), mean(w)
    spread = mean((q - mq) ** 2)
    fit = mean((q - mq) * (w - mw)) / jnp.where(spread > 0, spread, 1.0)
  else:
    spread = mean(q * q)
    fit = mean(q * w) / jnp.where(spread > 0, spread, 1.0)
  good = (spread > 0) & (fit > 0)
  new_scale = jnp.where(good, fit, scale)
  if not offsets:
    return new_scale, offset
  return new_scale, jnp.where(good, mw - fit * mq, offset)


def dequantize(weight: QuantizedWeight) -> Float[Array, "... A B"]:
  """The float32 value of `weight` (tests, `save_hf` to a float checkpoint)."""
  q = weight.q.astype(jnp.float32)
  value = q * _expand(weight.scale, weight)
  if weight.offset is not None:
    value = value + _expand(weight.offset, weight)
  return value


def _expand(per_group: Float[Array, "... G B"], weight: QuantizedWeight) -> Float[Array, "..."]:
  return jnp.repeat(per_group, weight.group, axis=weight.axis)


def _split_groups(w: Array, axis: int, group: int) -> Array:
  """`w [..., A, B]` with its `axis` split into (groups, group)."""
  shape = list(w.shape)
  at = w.ndim + axis
  shape[at:at + 1] = [shape[at] // group, group]
  return w.reshape(shape)


def product(x: Float[Array, "... D"], weight: QuantizedWeight, out_dtype) -> Float[Array, "... F"]:
  """`x @ value(weight)` (`axis=-1`: `x @ value.T`, contracted in place), in float32 then
  `out_dtype`; see the module for how each platform computes it."""
  rows = x.reshape(-1, x.shape[-1])  # [M, D]
  if platform.is_cpu():
    out = _integer_product(rows, weight)
  else:  # one row computed as two, as `numerics.linear` computes a bfloat16 one (XLA:GPU
    #      makes a one-row product a multiply and a reduce; two rows are one product)
    out = _fused_product(jnp.broadcast_to(rows, (max(2, rows.shape[0]), rows.shape[1])),
                         weight)[:rows.shape[0]]
  return out.reshape(*x.shape[:-1], out.shape[-1]).astype(out_dtype)


def _grouped(weight: QuantizedWeight) -> tuple[Array, tuple[int, int]]:
  """q as `[G, g, F]` (axis -2) or `[F, G, g]` (axis -1), and the (group, batch) axes a
  product with `[M, G, g]` rows contracts and batches it on."""
  groups = weight.scale.shape[weight.axis]
  q = weight.q
  if weight.axis == -2:
    return q.reshape(groups, q.shape[0] // groups, q.shape[1]), (1, 0)
  return q.reshape(q.shape[0], groups, q.shape[1] // groups), (2, 1)


def _per_group(per_column: Float[Array, "G F"] | Float[Array, "F G"], axis: int
               ) -> Float[Array, "G F"]:
  return per_column if axis == -2 else per_column.T


def _integer_product(rows: Float[Array, "M D"], weight: QuantizedWeight) -> Float[Array, "M F"]:
  """CPU: two int8 terms per row and group times q, accumulated in int32 per group."""
  m, d = rows.shape
  groups = weight.scale.shape[weight.axis]
  x = rows.astype(jnp.float32).reshape(m, groups, d // groups)  # [M, G, g]
  step = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / STEP  # [M, G, 1]
  step = jnp.where(step == 0, 1.0, step)
  first = jnp.round(x / step)
  fine = step / REMAINDER_STEPS
  second = jnp.round((x - first * step) / fine)
  terms = jnp.concatenate([first, second]).astype(jnp.int8)  # [2M, G, g]
  q, (inner, batch) = _grouped(weight)
  q = q if q.dtype == jnp.int8 else q.astype(jnp.int8)
  sums = jax.lax.dot_general(terms, q, (((2,), (inner,)), ((1,), (batch,))),
                             preferred_element_type=jnp.int32).astype(jnp.float32)  # [G, 2M, F]
  step, fine = (jnp.swapaxes(a, 0, 1) for a in (step, fine))  # [G, M, 1]
  per_group = sums[:, :m] * step + sums[:, m:] * fine  # [G, M, F]
  out = jnp.sum(per_group * _per_group(weight.scale, weight.axis)[:, None, :], axis=0)  # [M, F]
  if weight.offset is not None:
    out = out + x.sum(-1) @ _per_group(weight.offset, weight.axis)
  return out


def _fused_product(rows: Float[Array, "M D"], weight: QuantizedWeight) -> Float[Array, "M F"]:
  """GPU / TPU: q converted in the product's operand, the scales on its float32 output:
  one product per column scale, or a product batched over the groups whose partial sums
  a reduction scales and adds (module)."""
  dtype = jnp.dtype(weight.dtype)
  m, d = rows.shape
  groups = weight.scale.shape[weight.axis]
  if groups == 1 and weight.offset is None:  # a scale per column: one product
    contract = (((1,), (weight.q.ndim + weight.axis,)), ((), ()))
    out = jax.lax.dot_general(rows.astype(dtype), weight.q.astype(dtype), contract,
                              preferred_element_type=jnp.float32)  # [M, F]
    return out * weight.scale.reshape(-1)
  q, (inner, batch) = _grouped(weight)
  x = rows.astype(dtype).reshape(m, groups, d // groups)  # [M, G, g]
  sums = jax.lax.dot_general(x, q.astype(dtype), (((2,), (inner,)), ((1,), (batch,))),
                             preferred_element_type=jnp.float32)  # [G, M, F]
  scaled = sums * _per_group(weight.scale, weight.axis)[:, None, :]  # [G, M, F]
  if weight.offset is not None:  # each group's inputs' sum times its offsets, added in the
    #                              same reduction (no product more: float32 exact on a TPU)
    sums_x = x.astype(jnp.float32).sum(-1).T  # [G, M]
    scaled = scaled + sums_x[:, :, None] * _per_group(weight.offset, weight.axis)[:, None, :]
  return jnp.sum(scaled, axis=0)  # [M, F]


# the params' matrices a quantized model holds as `QuantizedWeight`s (one device's fused
# names and a mesh's split ones); the embedding's groups run along its last axis
MATRICES = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down", "lm_head")


def check_scheme(scheme: str, group: int | None) -> int:
  """The bits of `scheme` ("int8" or "int4"); a one-line `MdjaxError` naming a bad one."""
  if scheme not in SCHEMES:
    raise MdjaxError(f"unknown quantize={scheme!r}; valid: {', '.join(SCHEMES)}, gguf")
  if group is not None and (scheme != "int4" or not isinstance(group, int) or group < 1):
    raise MdjaxError(f"quantize_group={group!r} applies to quantize='int4' only, as a "
                     "positive int (int8 keeps one scale per output)")
  return 8 if scheme == "int8" else 4


def scheme_label(scheme: str, group: int | None) -> str:
  """What `Model.quantization` says of `scheme`: "int8", or int4's groups and what it
  keeps in int8."""
  if scheme == "int8":
    return scheme
  return f"int4, groups of {group or INT4_GROUP} with offsets; embedding and head int8"


def quantize_weights(weights: dict, scheme: str, group: int | None = None) -> dict:
  """One dict of named weights (a layer's, or the top-level ones without "layers") with
  every matrix quantized by `scheme`: "int8" (a scale per output), "int4" (groups of
  `group` inputs, `INT4_GROUP` unless given, with offsets; the embedding and an untied
  head int8); norms and biases stay float. A loader applies it to each dict as it reads
  it, so at most one layer's float weights are held beside the quantized ones
  (`mdjax.checkpoints.hf.load_hf_dir`)."""
  bits = check_scheme(scheme, group)
  group = (group or INT4_GROUP) if bits == 4 else None

  def one(name: str, weight, axis: int):
    if is_quantized(weight):
      raise MdjaxError(f"quantize={scheme!r}: the model's {name!r} is quantized already "
                       f"({weight.bits}-bit); load its float checkpoint to quantize it again")
    if bits == 4 and name in INT4_KEEPS_INT8:
      return quantize(weight, 8, axis=axis)
    return quantize(weight, bits, group, axis=axis, offsets=bits == 4)

  return map_matrices(weights, one)


def quantize_params(params: dict, scheme: str, group: int | None = None) -> dict:
  """`params` (one layer list or a stack) with every matrix quantized by `scheme`
  (`quantize_weights`)."""
  return map_weight_dicts(params, lambda weights: quantize_weights(weights, scheme, group))


def map_matrices(weights: dict, one) -> dict:
  """One dict of named weights with each matrix (`MATRICES`, and the embedding) replaced
  by `one(name, weight, axis)`, `axis` the one its products contract (-1 for the `[V, D]`
  embedding, -2 for the others); norms and biases as they are."""
  return {name: one(name, w, -1) if name == "embed" else one(name, w, -2) if name in MATRICES
          else w for name, w in weights.items()}


def map_weight_dicts(params: dict, fn) -> dict:
  """`params` with `fn` applied to its top-level weights (all but "layers") and to each
  layer's dict (a list), or to the stacked layers' one dict."""
  layers = params["layers"]
  top = fn({n: w for n, w in params.items() if n != "layers"})
  return {**top, "layers": [fn(lp) for lp in layers] if isinstance(layers, list)
          else fn(layers)}
