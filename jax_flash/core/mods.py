"""User-written mask and score modifications (flex attention) in a form every
backend reads: a function applied elementwise with broadcasting, hashable by
the function itself (a jit static).

A function that closes over arrays (document ids, per-head windows) is kept
as its jaxpr with the arrays hoisted into arguments (`flex._elementwise`),
and `evaluate` runs that jaxpr. Given arrays, it is plain evaluation (the
blockwise loops, where gradients reach a score_mod's arrays). Given
`ArrayReader`s instead (a kernel's refs), every use of such an array must be
a read of one element (`a[i]`, `a[b, i]`, `jnp.take(a, i)`: what a function
written for scalar indices does): each becomes a read of the ref at the
(clamped) index, which jnp.vectorize turns into one gather per index tile.
Anything else done to a whole array raises `UnsupportedRead`
(`unsupported_reads` asks before a kernel is picked).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class ElementwiseMod:
  """`fn` (a mask_mod(b, h, q_idx, kv_idx, *consts) or a score_mod(score, b,
  h, q_idx, kv_idx, *consts)) applied elementwise: the index arguments
  broadcast against each other, so a function written for scalars works on
  the index tiles of a kernel or a block. `consts` are the arrays the user's
  function closed over, hoisted into arguments (`flex._elementwise`; they
  travel in `Operands.mask_consts` / `score_consts`: the score_mod's
  floating ones get gradients); a kernel passes `ArrayReader`s of its refs."""
  fn: Callable

  def __call__(self, *args, consts=()):
    return jnp.vectorize(lambda *xs: self.fn(*xs, *consts))(*args)


@dataclasses.dataclass(frozen=True)
class ArrayReader:
  """An array read one element at a time: `read(indices)` (one int32
  scalar per axis, in bounds) returns that element."""
  shape: tuple[int, ...]
  dtype: Any
  read: Callable

  @classmethod
  def of_ref(cls, ref) -> ArrayReader:
    return cls(tuple(ref.shape), ref.dtype, lambda idx: ref[idx])


class UnsupportedRead(ValueError):
  """A use of a closed-over array other than reading one element."""


@dataclasses.dataclass(frozen=True)
class _View:
  """Part of an `ArrayReader`: per axis, None (every index still) or
  (index, kept): a fixed index, kept as a dimension of size 1 or dropped."""
  reader: ArrayReader
  axes: tuple

  @property
  def dims(self) -> list[int]:
    """The reader's axes that are dimensions of this view."""
    return [a for a, x in enumerate(self.axes) if x is None or x[1]]

  def fixed(self) -> bool:
    return all(x is not None for x in self.axes)

  def value(self):
    """The element (shaped like the view: kept axes of size 1)."""
    x = self.reader.read(tuple(i for i, _ in self.axes))
    return jnp.reshape(x, tuple(1 for x in self.axes if x[1]))


def _clamp(index, size: int):
  return jnp.clip(jnp.asarray(index, jnp.int32), 0, size - 1)


def _dynamic_slice(view: _View, starts, slice_sizes):
  axes = list(view.axes)
  for axis, start, size in zip(view.dims, starts, slice_sizes):
    n = view.reader.shape[axis]
    if axes[axis] is not None:  # A kept axis of size 1.
      continue
    if size == 1:
      axes[axis] = (_clamp(start, n), True)
    elif size != n:  # A whole axis stays; a part of one is not an element.
      raise UnsupportedRead(
          f"a slice of {size} of {n} entries of a closed-over array")
  return _View(view.reader, tuple(axes))


def _squeeze(view: _View, dimensions):
  axes = list(view.axes)
  for d in dimensions:
    axis = view.dims[d]
    axes[axis] = (axes[axis][0] if axes[axis] else jnp.int32(0), False)
  return _View(view.reader, tuple(axes))


def _fill_value(dtype, fill_value):
  if fill_value is not None:
    return fill_value
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.inexact):
    return np.nan
  if np.issubdtype(dtype, np.signedinteger):
    return np.iinfo(dtype).min
  if np.issubdtype(dtype, np.unsignedinteger):
    return np.iinfo(dtype).max
  return True


def _gather(view: _View, indices, *, dimension_numbers, slice_sizes, mode,
            fill_value, **_):
  """A gather of one element (what `a[i]` on a traced scalar i can be)."""
  dn = dimension_numbers
  dims = view.dims
  if (dn.offset_dims or dn.operand_batching_dims or any(
      s != 1 for s in slice_sizes) or sorted(dn.collapsed_slice_dims) != list(
          range(len(dims))) or jnp.shape(indices) != (
              len(dn.start_index_map),)):
    raise UnsupportedRead("a gather of more than one element of a "
                          "closed-over array")
  axes = list(view.axes)
  for axis in dims:  # Every dimension collapses; unindexed ones start at 0.
    axes[axis] = (jnp.int32(0) if axes[axis] is None else axes[axis][0],
                  False)
  valid = True
  for k, d in enumerate(dn.start_index_map):
    axis, index = dims[d], indices[k]
    if view.axes[axis] is None:
      n = view.reader.shape[axis]
      valid = valid & (index >= 0) & (index < n)
      axes[axis] = (_clamp(index, n), False)
  out = _View(view.reader, tuple(axes)).value()
  if mode == lax.GatherScatterMode.FILL_OR_DROP:
    out = jnp.where(valid, out, jnp.asarray(
        _fill_value(view.reader.dtype, fill_value), out.dtype))
  return out


def _bind(eqn, ins) -> list:
  """The equation's primitive applied to `ins` (as `jax.core.eval_jaxpr`
  does)."""
  outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
  return outs if eqn.primitive.multiple_results else [outs]


def evaluate(jaxpr, consts, *args):
  """The outputs of `jaxpr` (a `jax.extend.core.Jaxpr`) on `consts` and
  `args`, where any const may be an `ArrayReader` (see the module doc)."""
  env = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  def value(x):
    if isinstance(x, _View):
      if not x.fixed():
        raise UnsupportedRead("a whole closed-over array used at once")
      return x.value()
    return x

  for var, x in zip(jaxpr.constvars, consts):
    env[var] = _View(x, (None,) * len(x.shape)) if isinstance(
        x, ArrayReader) else x
  for var, x in zip(jaxpr.invars, args):
    env[var] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if not any(isinstance(x, _View) for x in ins):
      outs = _bind(eqn, ins)
    elif name in ("pjit", "jit", "closed_call", "core_call"):
      inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      inner_consts = getattr(inner, "consts", ())
      inner = getattr(inner, "jaxpr", inner)
      outs = evaluate(inner, inner_consts, *ins)
    elif name == "dynamic_slice" and isinstance(ins[0], _View):
      outs = [_dynamic_slice(ins[0], [value(x) for x in ins[1:]],
                             eqn.params["slice_sizes"])]
    elif name == "squeeze" and isinstance(ins[0], _View):
      outs = [_squeeze(ins[0], eqn.params["dimensions"])]
    elif name == "gather" and isinstance(ins[0], _View):
      outs = [_gather(ins[0], value(ins[1]), **eqn.params)]
    else:
      try:
        ins = [value(x) for x in ins]
      except UnsupportedRead as e:
        raise UnsupportedRead(f"{e} (by `{name}`)") from None
      outs = _bind(eqn, ins)
    for var, x in zip(eqn.outvars, outs):
      env[var] = x
  return [value(read(v)) for v in jaxpr.outvars]


@functools.lru_cache(maxsize=256)
def reads_batch_or_head(mod: ElementwiseMod, num_args: int) -> bool:
  """Whether `mod` (a mask_mod of 4 index arguments, or a score_mod of a
  score and 4: `num_args`) uses its batch or head index, which a device
  holding a shard of the batch or the heads would count from its shard's
  first (a mod with arrays is not asked: they stay on one device)."""
  args = [jnp.int32(0)] * num_args
  if num_args == 5:
    args[0] = jnp.float32(0)
  jaxpr = jax.make_jaxpr(mod.fn)(*args).jaxpr
  indices = jaxpr.invars[num_args - 4:num_args - 2]
  used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
  used |= {id(v) for v in jaxpr.outvars}
  return any(id(v) in used for v in indices)


def unsupported_reads(mod: ElementwiseMod, consts, num_args: int) -> str | None:
  """Why a kernel cannot run `mod` with `consts` as refs (a use of one that
  is not an element read), or None. Traced on index tiles, as kernels call
  it (no array is read)."""
  readers = tuple(ArrayReader(tuple(c.shape), c.dtype,
                              lambda idx, c=c: jnp.zeros((), c.dtype))
                  for c in consts)
  tiles = (jnp.zeros((8, 1), jnp.int32), jnp.zeros((1, 8), jnp.int32))
  args = (jnp.int32(0),) * 2 + tiles
  if num_args == 5:
    args = (jnp.zeros((8, 8), jnp.float32),) + args
  try:
    jax.make_jaxpr(lambda *xs: mod(*xs, consts=readers))(*args)
  except UnsupportedRead as e:
    return str(e)
  return None
