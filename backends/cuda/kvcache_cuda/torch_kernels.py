"""Pure-torch implementation of every kernel: vectorised, float32 math (float64 RoPE angles).

It runs on CPU tensors (what CI exercises through ``CudaBackend(device="cpu")``) and on GPU
tensors (the cross-check for the Triton kernels). Unlike the Triton path it may synchronise the
host (boolean masks, one ``.item()`` for the widest entry); it is a fallback and an oracle, not
the fast path.

Every function takes ``ctx`` (page_size, num_qo_heads, num_kv_heads, head_dim, head_dim_v,
group, dtype). K is the first ``head_dim`` entries of a page row, V the first ``head_dim_v``.
``kv_scale`` (2, Hkv) float32 comes with fp8 pages (``ctx.kv_quant``): appends store
``kvcache.kv_quant``'s codes, attention reads ``code * scale``, and the ragged pass rounds its
own K/V through the codes first.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
FP8_MAX = 448.0


# ---------------------------------------------------------------------- fp8 pages
def fp8_codes(x, scale, dtype):
    """e4m3fn codes of ``x`` (..., Hkv, D) rounded to the compute ``dtype`` first, with
    ``scale`` (Hkv,) float32: ``clip(x / scale, -448, 448)``, NaN kept."""
    y = x.to(dtype).float() / scale.float()[:, None]
    return torch.where(torch.isnan(y), y, y.clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)


def fp8_values(codes, scale):
    """float32 values of e4m3fn ``codes`` (..., Hkv, D) with ``scale`` (Hkv,)."""
    return codes.float() * scale.float()[:, None]


def _roundtrip(ctx, x, scale):
    """``x`` as fp8 pages with ``scale`` give it back (float32)."""
    return fp8_values(fp8_codes(x, scale, ctx.dtype), scale)


# ---------------------------------------------------------------------- RoPE
def rope_cos_sin(positions, head_dim: int, rope):
    """cos, sin of shape positions.shape + (R/2,) (R: the rotary dims), float32, angles computed
    in float64."""
    freqs = torch.as_tensor(rope.frequencies(head_dim), dtype=torch.float64, device=positions.device)
    ang = positions.to(torch.float64)[..., None] * freqs
    return torch.cos(ang).float(), torch.sin(ang).float()


def rotate(x, positions, rope):
    """Rotate-half RoPE in float32 over the first R dims (the rest pass through). x (..., H, D),
    positions x.shape[:-2]."""
    x = x.float()
    rot = rope.rotary(x.shape[-1])
    half = rot // 2
    cos, sin = rope_cos_sin(positions, x.shape[-1], rope)
    cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2 = x[..., :half], x[..., half:rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], dim=-1)


def rope(ctx, x, positions, rope_spec):
    return rotate(x, positions.long(), rope_spec).to(ctx.dtype)


def _kept(ctx, slots):
    """(kept token indices, their pages, their rows) of ``slots`` (-1: skipped); None when no
    token is kept."""
    slots = slots.long()
    keep = (slots >= 0).nonzero().squeeze(1)      # host sync: fine for the fallback path
    if keep.numel() == 0:
        return None
    s = slots[keep]
    return keep, s // ctx.page_size, s % ctx.page_size


def append_kv(ctx, pages, k, v, slots, positions=None, rope_spec=None, kv_scale=None):
    kept = _kept(ctx, slots)
    if kept is None:
        return
    keep, page, row = kept
    kk = k[keep]
    vv = v[keep]
    if rope_spec is not None:
        kk = rotate(kk, positions.long()[keep], rope_spec)
    if kv_scale is not None:
        kk, vv = fp8_codes(kk, kv_scale[0], ctx.dtype), fp8_codes(vv, kv_scale[1], ctx.dtype)
    # advanced indices split by a slice: the indexed dims come first -> (n, Hkv, D)
    pages[page, 0, :, row, :kk.shape[-1]] = kk.to(pages.dtype)
    pages[page, 1, :, row, :v.shape[-1]] = vv.to(pages.dtype)


def append_kv_layers(ctx, pages_per_layer, k, v, slots):
    """``append_kv`` of ``k[l]`` / ``v[l]`` into ``pages_per_layer[l]`` for every layer (no RoPE,
    no fp8 scales), the kept slots found once for all layers."""
    kept = _kept(ctx, slots)
    if kept is None:
        return
    keep, page, row = kept
    for pages, kl, vl in zip(pages_per_layer, k, v):
        pages[page, 0, :, row, :kl.shape[-1]] = kl[keep].to(pages.dtype)
        pages[page, 1, :, row, :vl.shape[-1]] = vl[keep].to(pages.dtype)


def rope_append(ctx, pages, q, k, v, slots, positions, rope_spec, kv_scale=None):
    q_rot = rope(ctx, q, positions, rope_spec)
    k_rot = rope(ctx, k, positions, rope_spec)
    append_kv(ctx, pages, k_rot, v, slots, kv_scale=kv_scale)
    return q_rot, k_rot


# ---------------------------------------------------------------------- softmax core
def _attend(q, k, v, visible, sm_scale, group, softcap=0.0, sinks=None):
    """q (B, n, Hq, D), k (B, m, Hkv, D), v (B, m, Hkv, Dv) float32, visible (B, n, m) bool
    -> o (B, n, Hq, Dv), lse (B, n, Hq). ``softcap`` > 0: scores become c * tanh(s / c);
    ``sinks`` (Hq,) float32: one more logit per head in every row's denominator, no value."""
    b, n, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    qg = q.view(b, n, hkv, group, d)
    logits = torch.einsum("bnhgd,bmhd->bhgnm", qg, k) * sm_scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~visible[:, None, None], NEG_INF)
    peak = logits.amax(dim=-1, keepdim=True)
    sink = None
    if sinks is not None:                     # (1, Hkv, G, 1, 1): the sink joins the peak
        sink = sinks.float().view(1, hkv, group, 1, 1)
        peak = torch.maximum(peak, sink)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w = torch.exp(logits - peak)
    denom = w.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - peak)
    empty = denom == 0                        # sees no key; a NaN denom (a NaN K seen) stays NaN
    out = _visible_sum(w / torch.where(empty, torch.ones_like(denom), denom), visible, v)
    lse = torch.where(empty, torch.full_like(peak, NEG_INF), torch.log(denom) + peak)[..., 0]
    return out.reshape(b, n, hq, dv), lse.permute(0, 3, 1, 2).reshape(b, n, hq)


def _empty_lse(shape, sinks, device):
    """The lse of rows that see no key: -inf, or each head's sink."""
    if sinks is None:
        return torch.full(shape, NEG_INF, dtype=torch.float32, device=device)
    return sinks.float().to(device).expand(shape).clone()


def _visible_sum(w, visible, v):
    """einsum("bhgnm,bmhd->bnhgd", w, v) over the keys each row sees. A masked key's weight is 0
    but its V may hold NaN/inf (a later token, a sibling branch) and 0 * NaN = NaN: non-finite
    values stay out of the einsum and are added back, key by key, to the rows that see them."""
    bad = ~torch.isfinite(v)
    out = torch.einsum("bhgnm,bmhd->bnhgd", w, v.masked_fill(bad, 0.0))
    for m in bad.any(dim=3).any(dim=2).any(dim=0).nonzero().flatten().tolist():   # host sync
        vm = v[:, m].masked_fill(~bad[:, m], 0.0)[:, None, :, None, :]          # (B, 1, Hkv, 1, D)
        add = w[..., m].permute(0, 3, 1, 2)[..., None] * vm                     # (B, n, Hkv, G, D)
        out = out + torch.where(visible[:, :, m, None, None, None], add, torch.zeros_like(add))
    return out


def _tree_nodes(tree, entry_idx, node_idx, ok):
    """(order, upper) of node ``node_idx`` of entry ``entry_idx`` (any broadcastable shapes)."""
    base = tree.indptr.long()[entry_idx] + node_idx
    base = torch.where(ok, base, torch.zeros_like(base))
    mask = tree.mask.long()
    return mask[2 * base], mask[2 * base + 1]


# ---------------------------------------------------------------------- ragged
def ragged_attention(ctx, q, k, v, qo_indptr, sm_scale, *, num_seqs, max_len, tree=None,
                     rope=None, q_positions=None, k_rope_offset=None, window_left=-1,
                     logit_softcap=0.0, sinks=None, kv_scale=None):
    t_total = q.shape[0]
    dev = q.device
    qo = qo_indptr.long()[: num_seqs + 1]
    tok = torch.arange(t_total, device=dev)
    seq = torch.searchsorted(qo[1:].contiguous(), tok, right=True).clamp(max=num_seqs - 1)
    r = tok - qo[seq]
    covered = (tok >= qo[0]) & (tok < qo[-1])
    qf = q.float()
    if kv_scale is None:
        kf, vf = k.float(), v.float()
    else:
        kf, vf = _roundtrip(ctx, k, kv_scale[0]), _roundtrip(ctx, v, kv_scale[1])
    if rope is not None:
        qf = rotate(qf, q_positions.long(), rope)
        kf = rotate(kf, k_rope_offset.long()[seq] + r, rope)
    L = max(int(max_len), 1)
    qp = q.new_zeros((num_seqs, L) + q.shape[1:], dtype=torch.float32)
    kp = q.new_zeros((num_seqs, L) + k.shape[1:], dtype=torch.float32)
    vp = q.new_zeros((num_seqs, L) + v.shape[1:], dtype=torch.float32)
    sel = covered.nonzero().squeeze(1)
    qp[seq[sel], r[sel]] = qf[sel]
    kp[seq[sel], r[sel]] = kf[sel]
    vp[seq[sel], r[sel]] = vf[sel]
    n = (qo[1:] - qo[:-1])[:, None, None]                      # (B, 1, 1)
    ar = torch.arange(L, device=dev)
    rows, cols = ar[None, :, None], ar[None, None, :]
    visible = (cols <= rows) & (cols < n) & (rows < n)
    if window_left >= 0:
        visible = visible & (cols >= rows - window_left)
    if tree is not None:
        ok = (ar[None, :] < n[:, :, 0])                         # (B, L)
        ent = torch.arange(num_seqs, device=dev)[:, None]
        order, upper = _tree_nodes(tree, ent, ar[None, :], ok)  # tree size == append length
        visible = visible & (order[:, None, :] <= order[:, :, None]) & (order[:, :, None] < upper[:, None, :])
    o, lse = _attend(qp, kp, vp, visible, sm_scale, ctx.group, logit_softcap, sinks)
    o_out = q.new_zeros((t_total, q.shape[1], v.shape[-1]), dtype=ctx.dtype)
    lse_out = _empty_lse((t_total, q.shape[1]), sinks, dev)
    o_out[sel] = o[seq[sel], r[sel]].to(ctx.dtype)
    lse_out[sel] = lse[seq[sel], r[sel]]
    return o_out, lse_out


# ---------------------------------------------------------------------- paged
def entry_key_slots(ctx, depth, max_kv):
    """(slots (n, max_kv) int64, valid (n, max_kv) bool): where key j of entry i lives."""
    n = depth.num_entries
    dev = depth.kv_len.device
    j = torch.arange(max_kv, device=dev)[None, :]
    kv_len = depth.kv_len.long()[:n, None]
    sink, gap = depth.sink_size.long()[:n, None], depth.window_offset.long()[:n, None]
    off = torch.where(j < sink, j, j - sink + gap)
    valid = j < kv_len
    pidx = depth.page_indptr.long()[:n, None] + off // ctx.page_size
    pidx = torch.where(valid, pidx, torch.zeros_like(pidx))
    indices = depth.page_indices.long()
    if indices.numel() == 0:
        return torch.zeros_like(pidx), valid & False
    page = indices[pidx.clamp(max=indices.numel() - 1)]
    return page * ctx.page_size + off % ctx.page_size, valid


def paged_attention(ctx, q, pages, depth, sm_scale, *, rope=None, q_positions=None,
                    window_left=-1, logit_softcap=0.0, sinks=None, kv_scale=None):
    t_total, hq, d = q.shape
    dv = ctx.head_dim_v
    dev = q.device
    o_out = torch.zeros((t_total, hq, dv), dtype=ctx.dtype, device=dev)
    lse_out = _empty_lse((t_total, hq), sinks, dev)
    n = depth.num_entries
    if n == 0 or t_total == 0:
        return o_out, lse_out
    # graph mode passes the cache's bound as max_kv_len; the fallback sizes by the real lengths
    max_kv = min(int(depth.max_kv_len), int(depth.kv_len[:n].max().item()))   # host sync: fallback only
    if max_kv == 0:
        return o_out, lse_out
    qo = depth.qo_indptr.long()[: n + 1]
    nq = qo[1:] - qo[:-1]
    max_q = int(nq.max().item()) if n else 0               # host sync: fallback path only
    if max_q == 0:
        return o_out, lse_out
    slots, valid = entry_key_slots(ctx, depth, max_kv)
    ps = ctx.page_size
    # padding keys read whatever sits in page 0 (maybe NaN-poisoned freed pages): zero them, as
    # a masked weight of 0 times a NaN value would still be NaN
    pad = ~valid[:, :, None, None]
    keys = pages[slots // ps, 0, :, slots % ps, :d].float()          # (n, M, Hkv, D)
    vals = pages[slots // ps, 1, :, slots % ps, :dv].float()
    if kv_scale is not None:
        keys, vals = keys * kv_scale[0].float()[:, None], vals * kv_scale[1].float()[:, None]
    keys, vals = keys.masked_fill(pad, 0.0), vals.masked_fill(pad, 0.0)
    tok = torch.arange(t_total, device=dev)
    ent = torch.searchsorted(qo[1:].contiguous(), tok, right=True).clamp(max=n - 1)
    r = tok - qo[ent]
    sel = ((tok >= qo[0]) & (tok < qo[-1])).nonzero().squeeze(1)
    qf = q.float()
    if rope is not None:
        qf = rotate(qf, q_positions.long(), rope)
        kpos = depth.k_rope_offset.long()[:n, None] + torch.arange(max_kv, device=dev)[None, :]
        keys = rotate(keys, kpos, rope)
    qp = q.new_zeros((n, max_q, hq, d), dtype=torch.float32)
    qp[ent[sel], r[sel]] = qf[sel]
    rows = torch.arange(max_q, device=dev)
    visible = valid[:, None, :] & (rows[None, :, None] < nq[:, None, None])   # (n, max_q, M)
    if depth.tree is not None:
        tind = depth.tree.indptr.long()
        ts = (tind[1:n + 1] - tind[:n])[:, None]                      # (n, 1)
        kv_len = depth.kv_len.long()[:n, None]
        j = torch.arange(max_kv, device=dev)[None, :]
        in_tree = (j >= kv_len - ts) & valid                          # (n, M)
        ent_ix = torch.arange(n, device=dev)[:, None]
        k_ord, k_up = _tree_nodes(depth.tree, ent_ix, j - (kv_len - ts), in_tree)
        q_node = ts - nq[:, None] + rows[None, :]                     # (n, max_q)
        q_ok = (rows[None, :] < nq[:, None]) & (ts > 0) & (q_node >= 0)
        q_ord, _ = _tree_nodes(depth.tree, ent_ix, q_node, q_ok)
        tree_vis = (k_ord[:, None, :] <= q_ord[:, :, None]) & (q_ord[:, :, None] < k_up[:, None, :])
        visible = visible & (~in_tree[:, None, :] | tree_vis)
    if window_left >= 0:
        qpos = torch.zeros((n, max_q), dtype=torch.long, device=dev)
        qpos[ent[sel], r[sel]] = q_positions.long()[sel]
        kpos = depth.k_rope_offset.long()[:n, None] + torch.arange(max_kv, device=dev)[None, :]
        visible = visible & (kpos[:, None, :] >= (qpos - window_left)[:, :, None])
    if ctx.batch_invariant:
        return _rows_alone(ctx, qp, keys, vals, visible, ent, r, sel, sm_scale, logit_softcap,
                           sinks, o_out, lse_out)
    o, lse = _attend(qp, keys, vals, visible, sm_scale, ctx.group, logit_softcap, sinks)
    o_out[sel] = o[ent[sel], r[sel]].to(ctx.dtype)
    lse_out[sel] = lse[ent[sel], r[sel]]
    return o_out, lse_out


def _rows_alone(ctx, qp, keys, vals, visible, ent, r, sel, sm_scale, softcap, sinks, o_out,
                lse_out):
    """Batch-invariant paged attention: each row by itself over its keys up to the last it
    sees, so every reduction has a length set by the row alone (not by its entry's length or
    the rows beside it)."""
    for t in sel.tolist():
        e, i = int(ent[t]), int(r[t])
        vis = visible[e, i]
        seen = vis.nonzero()
        if not len(seen):
            continue
        m = int(seen[-1]) + 1
        o, lse = _attend(qp[e:e + 1, i:i + 1], keys[e:e + 1, :m], vals[e:e + 1, :m],
                         vis[None, None, :m], sm_scale, ctx.group, softcap, sinks)
        o_out[t] = o[0, 0].to(ctx.dtype)
        lse_out[t] = lse[0, 0]
    return o_out, lse_out


# ---------------------------------------------------------------------- merge / copies
def merge_attention(ctx, o_a, lse_a, o_b, lse_b):
    la, lb = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(la, lb)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.where(torch.isfinite(la), torch.exp(la - safe), torch.zeros_like(la))[..., None]
    wb = torch.where(torch.isfinite(lb), torch.exp(lb - safe), torch.zeros_like(lb))[..., None]
    o = o_a.float() * wa + o_b.float() * wb
    return o.to(ctx.dtype), lse


def copy_page_prefix(ctx, pages_per_layer, src_page, dst_page, length):
    for pages in pages_per_layer:
        pages[dst_page, :, :, :length].copy_(pages[src_page, :, :, :length])


def gather_rows(ctx, pages, slots):
    """(k, v), (n, Hkv, D) and (n, Hkv, Dv), of the rows at ``slots`` of one layer."""
    slots = slots.long()
    page, row = slots // ctx.page_size, slots % ctx.page_size
    return pages[page, 0, :, row, :ctx.head_dim], pages[page, 1, :, row, :ctx.head_dim_v]


def compact_kv(ctx, pages_per_layer, src_slots, dst_slots):
    src, dst = src_slots.long(), dst_slots.long()
    ps = ctx.page_size
    for pages in pages_per_layer:
        rows = pages[src // ps, :, :, src % ps, :]     # advanced indexing copies: read-before-write
        pages[dst // ps, :, :, dst % ps, :] = rows


def gather_kv(ctx, pages_per_layer, slots, kv_scale=None):
    rows = [gather_rows(ctx, p, slots) for p in pages_per_layer]
    if kv_scale is not None:       # fp8 codes -> values in the cache dtype, per page array
        rows = [(fp8_values(k, s[0]).to(ctx.dtype), fp8_values(v, s[1]).to(ctx.dtype))
                for (k, v), s in zip(rows, kv_scale)]
    ks, vs = [k for k, _ in rows], [v for _, v in rows]
    if ctx.head_dim == ctx.head_dim_v:       # V right behind K (a transfer's one message)
        return torch.stack([torch.stack(ks), torch.stack(vs)]).unbind(0)
    return torch.stack(ks), torch.stack(vs)
