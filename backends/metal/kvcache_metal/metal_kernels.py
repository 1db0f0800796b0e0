"""Metal kernels through ``mx.fast.metal_kernel`` (Apple GPU only).

UNVERIFIED: written against MLX's documented ``metal_kernel`` API but never compiled or run,
because the machines this project is built and tested on have no Apple GPU. It is used only when
``MetalBackend`` runs on the Apple GPU (``device='gpu'``) and ``KVCACHE_METAL_OPS_ONLY`` is unset;
everywhere else (and in every test here) the MLX-ops path of ``ops.py`` runs. The first run on an
Apple GPU must be ``pytest tests/metal`` with ``KVCACHE_METAL_TEST_DEVICE=gpu``, which compares it
with the reference backend.

``paged_decode``: one SIMD group (32 threads) per (entry, query head); each thread holds D/32
dimensions of the query and of the accumulator; keys are read through the page table (with the
sliding-window sink/gap mapping) one at a time with an online softmax. Entries have exactly one
query (``DepthAux.use_decode``); no tree mask, no inline RoPE (those go to the ops path).
"""

from __future__ import annotations

import mlx.core as mx

_SOURCE = r"""
    uint lane = thread_position_in_threadgroup.x;
    uint h = threadgroup_position_in_grid.y;
    uint e = threadgroup_position_in_grid.z;
    constexpr int PER = D / 32;
    int qrow = qo_indptr[e];
    int L = kv_len[e];
    int sink = sink_size[e];
    int gap = window_offset[e];
    int pbase = page_indptr[e];
    int kvh = h / GROUP;
    float scale = sm_scale[0];
    float qv[PER];
    float acc[PER];
    for (int i = 0; i < PER; ++i) {
        qv[i] = float(q[(qrow * HQ + h) * D + lane + 32 * i]) * scale;
        acc[i] = 0.0f;
    }
    float m = -INFINITY;
    float s = 0.0f;
    for (int j = 0; j < L; ++j) {
        int off = j < sink ? j : j - sink + gap;
        int page = page_indices[pbase + off / PS];
        int row = off % PS;
        long kbase = ((((long)page * 2 + 0) * HKV + kvh) * PS + row) * D;
        long vbase = ((((long)page * 2 + 1) * HKV + kvh) * PS + row) * D;
        float dot = 0.0f;
        for (int i = 0; i < PER; ++i) {
            dot += qv[i] * float(pages[kbase + lane + 32 * i]);
        }
        dot = simd_sum(dot);
        float m_new = max(m, dot);
        float corr = exp(m - m_new);
        float p = exp(dot - m_new);
        s = s * corr + p;
        for (int i = 0; i < PER; ++i) {
            acc[i] = acc[i] * corr + p * float(pages[vbase + lane + 32 * i]);
        }
        m = m_new;
    }
    for (int i = 0; i < PER; ++i) {
        o[(e * HQ + h) * D + lane + 32 * i] = L > 0 ? acc[i] / s : 0.0f;
    }
    if (lane == 0) {
        lse[e * HQ + h] = L > 0 ? m + log(s) : -INFINITY;
    }
"""

_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.metal_kernel(
            name="kvcache_paged_decode",
            input_names=["q", "pages", "qo_indptr", "page_indptr", "page_indices", "kv_len",
                         "sink_size", "window_offset", "sm_scale"],
            output_names=["o", "lse"],
            source=_SOURCE,
        )
    return _kernel


def paged_decode(backend, q, pages, depth, sm_scale):
    """(o, lse) for all T rows of q; entries' single query rows filled, the rest o=0, lse=-inf."""
    from .ops import Output
    c = backend.config
    t, hq, d = q.shape
    n = int(depth.num_entries)
    out = Output(t, hq, d)
    if n == 0:
        return out.result(backend.dtype)
    o, lse = _get_kernel()(
        inputs=[q, pages, depth.qo_indptr, depth.page_indptr, depth.page_indices, depth.kv_len,
                depth.sink_size, depth.window_offset, mx.array([sm_scale], dtype=mx.float32)],
        template=[("D", d), ("PS", c.page_size), ("HKV", c.num_kv_heads), ("HQ", hq),
                  ("GROUP", c.group_size)],
        grid=(32, hq, n), threadgroup=(32, 1, 1),
        output_shapes=[(n, hq, d), (n, hq)], output_dtypes=[mx.float32, mx.float32],
        stream=backend.stream,
    )
    rows = depth.qo_indptr[:n][:, None]
    valid = mx.ones((n, 1), dtype=mx.bool_)
    out.put(rows, valid, o[:, None], lse[:, None])
    return out.result(backend.dtype)
