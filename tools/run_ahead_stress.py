"""Run-ahead stress for the cuda backend (GPU machine): the host never waits for the device.

    python tools/run_ahead_stress.py repro                  # the 32-layer prefill + decode case
    python tools/run_ahead_stress.py soak --forwards 2000   # randomised serving soak
    python tools/run_ahead_stress.py soak --forwards 2000 --graph   # decode steps as CUDA graphs

The soak drives one cache at serving shapes (Hq32/Hkv8/D128 bfloat16, 32 layers, batches up to
64, prefill chunks up to 4096, rope_mode none) with random adds, prefill chunks, decode steps,
mixed batches, forks, popn, removes and preemption on CacheFullError, and never reads anything
back until the end. Inputs are slices of random pools made on the device up front. A shadow
model keeps, per sequence and layer, which pool rows its K/V came from; after every forward the
output of one random layer is recomputed in float32 with torch SDPA from those rows, queued on
the same stream, and its error lands in a device tensor. At the end the errors are read, and
``get_kv`` of every live sequence must equal the shadow's rows bit for bit.
Exit status 0: every output within tolerance, every ``get_kv`` exact.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

import kvcache

H_Q, H_KV, D = 32, 8, 128
ATOL, RTOL = 2e-2, 2e-2        # bfloat16 output against a float32 recomputation


def repro(layers=32, ctx=4096, steps=3) -> int:
    cfg = kvcache.CacheConfig(num_layers=layers, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                              page_size=16, max_batch_size=64, max_total_tokens=2 * ctx + 64,
                              prefill_chunk_size=ctx, dtype="bfloat16", rope_mode="normal")
    c = kvcache.PagedKVCache(cfg, backend="cuda")
    c.add_sequence(0)
    q = torch.randn(ctx, H_Q, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(ctx, H_KV, D, device="cuda", dtype=torch.bfloat16)
    with c.forward([0], [ctx]):
        for layer in range(layers):
            c.attention(layer, q, k, k)
    for _ in range(steps):          # no synchronize: the prefill is still running
        with c.forward([0], [1]):
            for layer in range(layers):
                c.attention(layer, q[:1].contiguous(), k[:1].contiguous(), k[:1].contiguous())
    torch.cuda.synchronize()
    kk, _ = c.get_kv(0)
    ok = bool(torch.isfinite(kk.float()).all())
    print(f"repro: {layers} layers, {ctx}-token prefill + {steps} decode steps queued: "
          f"{'OK' if ok else 'NON-FINITE KV'}")
    return 0 if ok else 1


class Shadow:
    """Per sequence: (layers, n) pool row ids of its K and of its V."""

    def __init__(self, layers):
        self.layers = layers
        self.k: dict = {}
        self.v: dict = {}

    def add(self, sid):
        self.k[sid] = np.zeros((self.layers, 0), np.int64)
        self.v[sid] = np.zeros((self.layers, 0), np.int64)

    def remove(self, sid):
        del self.k[sid], self.v[sid]

    def fork(self, parent, child, pos):
        n = self.k[parent].shape[1] if pos < 0 else pos
        self.k[child], self.v[child] = self.k[parent][:, :n].copy(), self.v[parent][:, :n].copy()

    def popn(self, sid, n):
        self.k[sid], self.v[sid] = self.k[sid][:, :-n], self.v[sid][:, :-n]

    def length(self, sid):
        return self.k[sid].shape[1]


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self.layers = args.layers
        cfg = kvcache.CacheConfig(
            num_layers=args.layers, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
            page_size=16, max_batch_size=64, max_total_tokens=args.max_tokens,
            prefill_chunk_size=args.chunk, dtype="bfloat16", rope_mode="none",
            static_decode=args.graph)
        self.cache = kvcache.PagedKVCache(cfg, backend="cuda", device=args.device)
        self.dev = self.cache.backend.torch_device
        g = torch.Generator(device=self.dev).manual_seed(args.seed)
        n = self.pool_rows = args.chunk + 4096
        self.q_pool = torch.randn(n, H_Q, D, device=self.dev, dtype=torch.bfloat16, generator=g)
        self.k_pool = torch.randn(n, H_KV, D, device=self.dev, dtype=torch.bfloat16, generator=g)
        self.v_pool = torch.randn(n, H_KV, D, device=self.dev, dtype=torch.bfloat16, generator=g)
        self.shadow = Shadow(args.layers)
        self.next_id = 0
        self.errs = torch.zeros(args.forwards, device=self.dev, dtype=torch.float32)
        self.labels: list = []
        self.stats = dict(forwards=0, decode=0, prefill=0, mixed=0, forks=0, popn=0, removes=0,
                          preempted=0, graph_replays=0, tokens=0, begun_behind=0, max_in_flight=0)
        self.in_flight: list = []       # events of forwards the device may still be running
        self.weights = None
        if args.model_work and self.dev.type == "cuda":
            # a transformer layer's own matmuls (Llama-3-8B o-proj and MLP shapes), outputs dropped
            w = lambda m, n: torch.randn(m, n, device=self.dev, dtype=torch.bfloat16, generator=g) * 0.01
            self.weights = (w(H_Q * D, 4096), w(4096, 14336), w(14336, 4096))
        self.graphs = None
        if args.graph:
            from kvcache_cuda import DecodeGraphs
            self.graphs = DecodeGraphs(self.cache)
            self.static = None

    # ------------------------------------------------------------------ operations
    def new_seq(self):
        sid = self.next_id
        self.next_id += 1
        self.cache.add_sequence(sid)
        self.shadow.add(sid)
        return sid

    def remove(self, sid):
        self.cache.remove_sequence(sid)
        self.shadow.remove(sid)
        self.stats["removes"] += 1

    def offsets(self, total):
        hi = self.pool_rows - total + 1
        return self.rng.integers(0, hi, size=(3, self.layers))

    def forward(self, sids, lens):
        """One forward over every layer; verifies one random layer on the device."""
        total = int(sum(lens))
        off = self.offsets(total)
        check = int(self.rng.integers(0, self.layers))
        hist = {s: self.shadow.length(s) for s in sids}
        c = self.cache
        self._count_in_flight()
        c.begin_forward(list(sids), list(lens))
        bucket = c.static_bucket
        if bucket is not None and self.graphs is not None:
            o_check = self._graph_step(sids, off, check, bucket)
        else:
            o_check = None
            for layer in range(self.layers):
                q = self.q_pool[off[0, layer]:off[0, layer] + total]
                k = self.k_pool[off[1, layer]:off[1, layer] + total]
                v = self.v_pool[off[2, layer]:off[2, layer] + total]
                o = c.attention(layer, q, k, v)
                if layer == check:
                    o_check = o
                if self.weights is not None:
                    wo, w1, w2 = self.weights
                    (((o.view(total, -1) @ wo) @ w1) @ w2).sum()
        c.end_forward()
        if self.dev.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self.in_flight.append(ev)
        # the shadow appends the new rows
        start = 0
        for s, n in zip(sids, lens):
            rows_k = off[1][:, None] + start + np.arange(n)[None, :]
            rows_v = off[2][:, None] + start + np.arange(n)[None, :]
            self.shadow.k[s] = np.concatenate([self.shadow.k[s], rows_k], axis=1)
            self.shadow.v[s] = np.concatenate([self.shadow.v[s], rows_v], axis=1)
            start += n
        self._verify(sids, lens, hist, off, check, o_check)
        self.stats["forwards"] += 1
        self.stats["tokens"] += total

    def _count_in_flight(self):
        """How many earlier forwards the device has not finished (event queries never wait)."""
        while self.in_flight and self.in_flight[0].query():
            self.in_flight.pop(0)
        if self.in_flight:
            self.stats["begun_behind"] += 1
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(self.in_flight))

    def _graph_step(self, sids, off, check, bucket):
        """A graph-mode decode step: fill the bucket's static inputs, capture once per bucket,
        replay; returns the checked layer's real rows (cloned: the next replay rewrites them)."""
        n = len(sids)
        if self.static is None:     # fixed addresses for every bucket's graph: the largest bucket
            rows = self.cache.config.static_buckets[-1]
            self.static = [[torch.zeros(rows, h, D, device=self.dev, dtype=torch.bfloat16)
                            for h in (H_Q, H_KV, H_KV)] for _ in range(self.layers)]
        for layer in range(self.layers):
            for t, pool, o in zip(self.static[layer], (self.q_pool, self.k_pool, self.v_pool), off[:, layer]):
                t[:n].copy_(pool[o:o + n])
                t[n:bucket].zero_()

        def step():
            return [self.cache.attention(layer, *(t[:bucket] for t in self.static[layer]))
                    for layer in range(self.layers)]

        if bucket not in self.graphs.graphs:
            out = self.graphs.capture(step)
        else:
            out = self.graphs.replay()
            self.stats["graph_replays"] += 1
        return out[check][:n].clone()

    def _verify(self, sids, lens, hist, off, check, o):
        """Queue a float32 SDPA of layer ``check`` from the shadow rows; store max excess error."""
        b, t_max = len(sids), max(lens)
        k_max = max(hist[s] + n for s, n in zip(sids, lens))
        kidx = np.zeros((b, k_max), np.int64)
        vidx = np.zeros((b, k_max), np.int64)
        qidx = np.zeros((b, t_max), np.int64)
        out_idx = np.zeros((b, t_max), np.int64)
        start = 0
        for i, (s, n) in enumerate(zip(sids, lens)):
            ln = self.shadow.length(s)
            kidx[i, :ln] = self.shadow.k[s][check]
            vidx[i, :ln] = self.shadow.v[s][check]
            qidx[i, :n] = off[0, check] + start + np.arange(n)
            out_idx[i, :n] = start + np.arange(n)
            start += n
        meta = np.stack([np.array([hist[s] for s in sids]), np.array(lens)]).astype(np.int64)
        host = torch.from_numpy(np.concatenate([kidx.ravel(), vidx.ravel(), qidx.ravel(),
                                                out_idx.ravel(), meta.ravel()]))
        if self.dev.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.dev, non_blocking=True)
        sizes = [b * k_max, b * k_max, b * t_max, b * t_max, 2 * b]
        kd, vd, qd, od, md = torch.split(dev, sizes)
        kd, vd = kd.view(b, k_max), vd.view(b, k_max)
        qd, od, md = qd.view(b, t_max), od.view(b, t_max), md.view(2, b)
        group = H_Q // H_KV
        q = self.q_pool[qd].float().transpose(1, 2)                            # b, hq, t, d
        k = self.k_pool[kd].float().repeat_interleave(group, dim=2).transpose(1, 2)
        v = self.v_pool[vd].float().repeat_interleave(group, dim=2).transpose(1, 2)
        tq = torch.arange(t_max, device=self.dev)
        kk = torch.arange(k_max, device=self.dev)
        hist_d, lens_d = md[0][:, None, None], md[1][:, None, None]
        valid_q = tq[None, :, None] < lens_d                                   # b, t, 1
        mask = (kk[None, None, :] <= hist_d + tq[None, :, None]) | ~valid_q     # padded rows see all
        exp = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        exp = exp.transpose(1, 2)                                              # b, t, hq, d
        got = o.float()[od]                                                    # b, t, hq, d
        excess = ((got - exp).abs() - RTOL * exp.abs()) * valid_q[..., None]
        i = self.stats["forwards"]
        self.errs[i] = excess.amax()
        self.labels.append(f"forward {i}: {len(sids)} seqs, lens {lens if len(lens) < 6 else '...'}, layer {check}")

    # ------------------------------------------------------------------ the loop
    def live(self):
        return list(self.shadow.k)

    def step(self):
        live = self.live()
        r = self.rng.random()
        cfg = self.cache.config
        try:
            if not live or (len(live) < 48 and r < 0.12):
                n_new = int(self.rng.integers(1, 4))
                sids = [self.new_seq() for _ in range(n_new)]
                budget = self.args.chunk
                lens = [int(self.rng.integers(16, max(17, budget // n_new))) for _ in sids]
                self.forward(sids, lens)
                self.stats["prefill"] += 1
            elif r < 0.17 and live:
                parent = live[int(self.rng.integers(len(live)))]
                ln = self.shadow.length(parent)
                pos = int(self.rng.integers(0, ln + 1)) if self.rng.random() < 0.6 else -1
                child = self.next_id
                self.next_id += 1
                self.cache.fork_sequence(parent, child, pos)
                self.shadow.fork(parent, child, pos)
                self.stats["forks"] += 1
            elif r < 0.21 and live:
                s = live[int(self.rng.integers(len(live)))]
                ln = self.shadow.length(s)
                if ln > 1:
                    n = int(self.rng.integers(1, min(ln, 40)))
                    self.cache.popn(s, n)
                    self.shadow.popn(s, n)
                    self.stats["popn"] += 1
            elif r < 0.26 and len(live) > 2:
                self.remove(live[int(self.rng.integers(len(live)))])
            elif r < 0.34 and live:
                batch = list(self.rng.permutation(live)[:min(len(live), cfg.max_batch_size - 1)])
                sid = self.new_seq()
                self.forward([int(x) for x in batch] + [sid],
                             [1] * len(batch) + [int(self.rng.integers(2, self.args.chunk // 2))])
                self.stats["mixed"] += 1
            else:
                batch = [int(x) for x in self.rng.permutation(live)[:cfg.max_batch_size]]
                self.forward(batch, [1] * len(batch))
                self.stats["decode"] += 1
        except kvcache.CacheFullError:
            self.stats["preempted"] += 1        # preempt the longest sequence, as an engine would
            for s in [s for s in self.live() if self.shadow.length(s) == 0]:
                self.remove(s)
            live = self.live()
            if live:
                self.remove(max(live, key=self.shadow.length))

    def run(self) -> int:
        t0 = time.perf_counter()
        while self.stats["forwards"] < self.args.forwards:
            self.step()
        t_host = time.perf_counter() - t0
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
        errs = self.errs.cpu().numpy()
        bad = np.flatnonzero(~(errs <= ATOL))
        kv_bad = 0
        for s in self.live():
            k, v = self.cache.get_kv(s)
            ek = self.k_pool[torch.from_numpy(self.shadow.k[s]).to(self.dev)]
            ev = self.v_pool[torch.from_numpy(self.shadow.v[s]).to(self.dev)]
            if not (torch.equal(k, ek) and torch.equal(v, ev)):
                kv_bad += 1
                print(f"get_kv({s}) differs from the shadow (length {self.shadow.length(s)})")
        print(f"soak{' (graph mode)' if self.args.graph else ''}: {self.stats}")
        print(f"  host loop {t_host:.1f} s, device done {t_all:.1f} s (the host ran "
              f"{t_all - t_host:.1f} s ahead at the end); live sequences {len(self.live())}")
        print(f"  outputs checked: {len(errs)}, max excess error {float(np.nanmax(errs)) if len(errs) else 0:.4g}"
              f" (atol {ATOL}), bad: {len(bad)}; get_kv mismatches: {kv_bad}")
        for i in bad[:10]:
            print(f"  BAD {self.labels[i]}: excess {errs[i]}")
        return 0 if not len(bad) and not kv_bad else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("repro", help="the issue's 32-layer prefill then decode, no sync")
    r.add_argument("--layers", type=int, default=32)
    r.add_argument("--ctx", type=int, default=4096)
    s = sub.add_parser("soak", help="randomised serving soak, verified on the device")
    s.add_argument("--forwards", type=int, default=2000)
    s.add_argument("--layers", type=int, default=32)
    s.add_argument("--chunk", type=int, default=4096, help="prefill_chunk_size")
    s.add_argument("--max-tokens", type=int, default=98304, help="max_total_tokens")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--graph", action="store_true", help="decode steps captured and replayed")
    s.add_argument("--no-model-work", dest="model_work", action="store_false",
                   help="skip the per-layer model matmuls that keep the device busy as a model would")
    s.add_argument("--device", default=None,
                   help="cuda device (default); 'cpu' smoke-tests this script in the backend's "
                        "CPU test mode (KVCACHE_CUDA_CPU=1)")
    a = ap.parse_args(argv)
    if a.cmd == "repro":
        return repro(a.layers, a.ctx)
    return Soak(a).run()


if __name__ == "__main__":
    sys.exit(main())
