"""The packed layout of a short convolution over a forward of many sequences, shared by the
integrations that serve convolutions on the cache's state slots (transformers' and mlx-lm's;
docs/hybrid.md "Built: increment 5" and "Built: increment 6"), and the Mamba-2 mixers' and
gated DeltaNet layers' size rules both integrations check. Host index arrays and ints only: no
array library."""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=64)
def conv_indices(lengths: tuple, k1: int) -> tuple:
    """Host index arrays of one forward's convolution, for the sequences' ``lengths`` (their
    new tokens, in forward order) and ``k1`` state columns (the kernel's taps less one):
    ``(order (S*k1 + T,), out (T,), keep (S*k1,))``. The sources are the S states' columns
    (``s * k1 + c``: sequence ``s``'s column ``c``, the oldest first) then the T new columns.
    ``order`` lays them out as one block per sequence, its state then its tokens; ``out``
    picks each token's output of an unpadded convolution over that layout (the window that
    ends at the token and starts in its own block: no sequence reads another's inputs);
    ``keep`` the last ``k1`` columns of each block, the sequence's new state."""
    lens = np.asarray(lengths, np.int64)
    s, t = len(lens), int(lens.sum())
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])         # first token of each sequence
    block = np.arange(s) * k1 + starts                            # where each block begins
    seq_of = np.repeat(np.arange(s), lens)                        # each token's sequence
    order = np.empty(s * k1 + t, np.int64)
    cols = np.arange(k1)
    order[(block[:, None] + cols).ravel()] = np.arange(s * k1)    # the states' columns
    order[np.arange(t) + (seq_of + 1) * k1] = s * k1 + np.arange(t)
    out = np.arange(t) + seq_of * k1
    keep = (block + lens)[:, None] + cols
    return order, out, keep.ravel()


def checkpoint_columns(lengths: tuple, k1: int, marks: tuple) -> np.ndarray:
    """The columns of ``conv_indices``' layout holding each prefix-cache boundary's state
    (``marks``: ``cache.state_checkpoints()``, ``(row, n)`` pairs; docs/hybrid.md increment
    8): the ``k1`` inputs before the row's ``n``-th new token, its block's columns ``n .. n +
    k1 - 1`` (the state's own columns where ``n < k1``), ``k1`` per mark, marks in order."""
    lens = np.asarray(lengths, np.int64)
    block = np.arange(len(lens)) * k1 + np.concatenate([[0], np.cumsum(lens)[:-1]])
    first = np.array([block[row] + n for row, n in marks], np.int64)
    return (first[:, None] + np.arange(k1)).ravel()


def check_mamba_dims(refuse, heads: int, head_dim: int, groups: int, inner: int, conv_dim: int,
                     d_state: int) -> None:
    """A Mamba-2 mixer's sizes as both libraries' mixers lay them out: ``heads`` of
    ``head_dim`` tile ``inner`` (``intermediate_size``), ``groups`` divide the heads, and the
    conv runs over ``x``, ``B`` and ``C`` (``conv_dim = inner + 2 * groups * d_state``).
    ``refuse(reason)`` raises (UnsupportedFeatureError naming the layer) where they do not."""
    if heads < 1 or groups < 1 or heads % groups or heads * head_dim != inner:
        refuse(f"num_heads={heads}, head_dim={head_dim}, n_groups={groups}, "
               f"intermediate_size={inner}: the heads must tile intermediate_size and the groups "
               f"divide the heads")
    if conv_dim != inner + 2 * groups * d_state:
        refuse(f"conv_dim={conv_dim} is not intermediate_size + 2 * n_groups * ssm_state_size "
               f"({inner + 2 * groups * d_state})")


def check_gdn_dims(refuse, nk: int, nv: int, dk: int, dv: int, key_dim: int, value_dim: int,
                   conv_dim: int) -> None:
    """A gated DeltaNet layer's sizes as both libraries lay them out: ``nk`` key heads of
    ``dk`` tile ``key_dim``, ``nv`` value heads of ``dv`` tile ``value_dim``, the key heads
    divide the value heads, and the conv runs over q, k and v (``conv_dim = 2 * key_dim +
    value_dim``). ``refuse(reason)`` raises where they do not."""
    if nk < 1 or nv % nk or key_dim != nk * dk or value_dim != nv * dv:
        refuse(f"num_k_heads={nk}, num_v_heads={nv}, head_k_dim={dk}, head_v_dim={dv}, "
               f"key_dim={key_dim}, value_dim={value_dim}: the key heads must divide the value "
               f"heads and the heads tile key_dim and value_dim")
    if conv_dim != 2 * key_dim + value_dim:
        refuse(f"conv_dim={conv_dim} is not 2 * key_dim + value_dim ({2 * key_dim + value_dim})")
