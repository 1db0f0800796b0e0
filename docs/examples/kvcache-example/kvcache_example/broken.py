"""Deliberately broken variants of ``ExampleBackend``: each plants one classic kernel bug. They
exist to prove that the conformance suite catches such bugs; they are registered only when
``KVCACHE_EXAMPLE_BROKEN`` names them (comma-separated, or ``all``)."""

from __future__ import annotations

import numpy as np

from .backend import ExampleBackend


class BrokenPageIndex(ExampleBackend):
    """Forgets the entry's offset into the page table: reads ``page_indices[p]`` instead of
    ``page_indices[page_indptr[i] + p]`` (right for the first entry only)."""
    name = "example-broken-page-index"
    description = "planted defect: wrong page index"

    def _entry_pages(self, depth, i):
        count = int(depth.page_indptr[i + 1]) - int(depth.page_indptr[i])
        return np.asarray(depth.page_indices)[:count]


class BrokenCausalMask(ExampleBackend):
    """Ragged self-attention without the causal mask: a new token also sees later new tokens."""
    name = "example-broken-causal-mask"
    description = "planted defect: missed causal mask"

    def ragged_attention(self, q, k, v, qo_indptr, sm_scale, *, num_seqs, max_len, tree=None,
                         rope=None, q_positions=None, k_rope_offset=None):
        if tree is not None:
            return super().ragged_attention(q, k, v, qo_indptr, sm_scale, num_seqs=num_seqs,
                                            max_len=max_len, tree=tree)
        qo_indptr = np.asarray(qo_indptr)
        o, lse = self._new_output(q.shape[0])
        for i in range(num_seqs):
            lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
            if hi == lo:
                continue
            qi = self._split_heads(q[lo:hi])
            ki = np.asarray(k[lo:hi], np.float32).transpose(1, 0, 2)
            vi = np.asarray(v[lo:hi], np.float32).transpose(1, 0, 2)
            s = np.einsum("kgnd,kmd->kgnm", qi, ki) * np.float32(sm_scale)   # BUG: no mask
            m = s.max(axis=-1, keepdims=True)
            p = np.exp(s - m)
            den = p.sum(axis=-1, keepdims=True)
            o[lo:hi] = self._join_heads(np.einsum("kgnm,kmd->kgnd", p / den, vi))
            lse[lo:hi] = self._join_heads((m + np.log(den))[..., 0])
        return o.astype(self.dtype), lse


class BrokenUnwrittenOutput(ExampleBackend):
    """Reuses one output buffer across calls (as a CUDA-graph-friendly backend would) but only
    writes the rows of entries that have keys: rows of an entry with an empty history, or rows
    covered by no entry, keep whatever the previous call left (they must be o = 0, lse = -inf)."""
    name = "example-broken-unwritten-output"
    description = "planted defect: unwritten output rows"

    def _new_output(self, t):
        c = self.config
        cache = getattr(self, "_scratch", None)
        if cache is None or cache[0].shape[0] < t:
            cache = (np.zeros((t, c.num_qo_heads, c.head_dim), np.float32),
                     np.zeros((t, c.num_qo_heads), np.float32))     # BUG: never reset to 0 / -inf
            self._scratch = cache
        return cache[0][:t], cache[1][:t]

    def paged_attention(self, q, pages, depth, sm_scale, *, rope=None, q_positions=None):
        o, lse = super().paged_attention(q, pages, depth, sm_scale, rope=rope, q_positions=q_positions)
        return o, lse.copy()

    def ragged_attention(self, q, k, v, qo_indptr, sm_scale, **kw):
        o, lse = super().ragged_attention(q, k, v, qo_indptr, sm_scale, **kw)
        return o, lse.copy()


DEFECTS = {"page-index": BrokenPageIndex, "causal-mask": BrokenCausalMask,
           "unwritten-output": BrokenUnwrittenOutput}


def broken_backends(spec: str) -> list:
    names = list(DEFECTS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in DEFECTS]
    if unknown:
        raise ValueError(f"KVCACHE_EXAMPLE_BROKEN: unknown defect(s) {unknown}; known: {sorted(DEFECTS)}")
    return [DEFECTS[n] for n in names]
