"""The replay check: re-run the recorded cache calls of a sample of requests, one request at a
time, on a fresh reference-backend cache, and compare every attention output.

The attention output of a token depends only on its own sequence's history (the toy model's q/k/v
are functions of token ids; RoPE positions come from the cache), so a request replayed alone must
produce the outputs it got inside the batched run. The replay keeps the run's forward boundaries
(they matter for sliding windows), its forks, draft trees and commits. A preempted request
restarted from scratch; its final run is the one recorded and checked.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

import kvcache

from .model import ToyModel
from .workload import Workload

# (atol, rtol) per cache dtype: the reference computes in float64 and rounds once; a device kernel
# rounds q/k/v, probabilities and partial results in the storage dtype.
TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (1e-2, 1e-2), "bfloat16": (3e-2, 3e-2)}
PREFIX_SID = 1000


@dataclass
class CheckResult:
    cache: str
    dtype: str
    requests: int = 0
    tokens: int = 0
    values: int = 0
    max_err: float = 0.0
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def tolerance(self) -> tuple:
        return TOLERANCES[self.dtype]


def _prefill(ref, sid, tokens, bound, chunk):
    for lo in range(0, len(tokens), chunk):
        part = tokens[lo:lo + chunk]
        ref.begin_forward([sid], [len(part)])
        handle = bound.tokens(part)
        for layer in range(ref.config.num_layers):
            ref.attention_with_fused_qkv(layer, bound.qkv(handle, layer))
        ref.end_forward()


def replay_check(name: str, config: kvcache.CacheConfig, model: ToyModel, workload: Workload,
                 logs: dict, max_failures: int = 5) -> CheckResult:
    """Replay each logged request on the reference backend and compare outputs."""
    t0 = time.perf_counter()
    atol, rtol = TOLERANCES[config.dtype]
    result = CheckResult(name, config.dtype)
    ref = kvcache.PagedKVCache(dataclasses.replace(config, static_decode=False), backend="reference")
    bound = model.bind(ref)
    by_rid = {r.rid: r for r in workload.requests}
    prefix_sid: dict = {}     # shared prefixes are built once and kept, as in the run

    def build_prefix(key):
        if key in prefix_sid:
            return prefix_sid[key]
        p = workload.prefixes[key]
        parent = None if p.parent is None else build_prefix(p.parent)
        sid = PREFIX_SID + len(prefix_sid)
        if parent is None:
            ref.add_sequence(sid)
        else:
            ref.fork_sequence(parent, sid)
        _prefill(ref, sid, p.tokens, bound, config.prefill_chunk_size)
        prefix_sid[key] = sid
        return sid

    for rid in sorted(logs):
        log, req = logs[rid], by_rid[rid]
        for sid in ref.sequence_ids:
            if sid < PREFIX_SID:
                ref.remove_sequence(sid)
        result.requests += 1
        fwd_index = 0
        failed = False
        for op in log.ops:
            kind = op[0]
            if kind == "add":
                ref.add_sequence(op[1])
            elif kind == "fork_prefix":
                ref.fork_sequence(build_prefix(op[2]), op[1])
            elif kind == "window":
                ref.enable_sliding_window(op[1], *op[2])
            elif kind == "fork":
                ref.fork_sequence(op[1], op[2])
            elif kind == "commit":
                ref.commit_accepted_token_tree_nodes([i[0] for i in op[1]], [i[1] for i in op[1]])
            elif kind == "fwd":
                entries, tree = op[1], op[2]
                ptr = [p for e in entries for p in e[2]] if tree else None
                tokens = np.concatenate([e[1] for e in entries])
                ref.begin_forward([e[0] for e in entries], [len(e[1]) for e in entries], ptr)
                handle = bound.tokens(tokens)
                recorded = log.outputs[fwd_index]
                for layer in range(config.num_layers):
                    want = kvcache.to_numpy(ref.attention_with_fused_qkv(layer, bound.qkv(handle, layer)))
                    got = kvcache.to_numpy(recorded[layer]).astype(np.float32)
                    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
                    bad = ~(err <= atol + rtol * np.abs(want))
                    finite = err[np.isfinite(err)]
                    if finite.size:
                        result.max_err = max(result.max_err, float(finite.max()))
                    result.values += err.size
                    if bad.any() and not failed:
                        t, h, d = (int(x) for x in np.argwhere(bad)[0])
                        starts = np.cumsum([0] + [len(e[1]) for e in entries])
                        e = int(np.searchsorted(starts, t, "right") - 1)
                        result.failures.append(
                            f"[{name}] request {rid} ({', '.join(req.features)}): forward {fwd_index} "
                            f"of its run, layer {layer}, sample {entries[e][0]}, new token {t - starts[e]} "
                            f"of {len(entries[e][1])}, head {h}, dim {d}: run gave {got[t, h, d]:.6g}, "
                            f"reference {want[t, h, d]:.6g} (|err| {err[t, h, d]:.3g} > "
                            f"atol {atol:g} + rtol {rtol:g}*|ref|; {int(bad.sum())} of {bad.size} "
                            f"values differ in this layer)")
                        failed = True
                result.tokens += len(tokens)
                ref.end_forward()
                fwd_index += 1
            if failed:
                break
        if len(result.failures) >= max_failures:
            break
    result.seconds = time.perf_counter() - t0
    return result
