"""GPU proof (run by gpu_check.sh, needs CUDA): a forward issues exactly one host-to-device
memcpy, on the copy stream (not the stream the attention kernels run on), no device-to-host
copy, and no cudaDeviceSynchronize / cudaStreamSynchronize.

Usage: python tests/cuda/gpu_profile_check.py [OUT_DIR]   (exit status 0 = proven)
"""

import json
import os
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import kvcache

BAD_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize")


def one_forward(cache, rng, seq_ids, lengths, inputs):
    cache.begin_forward(seq_ids, lengths)
    for layer, (q, k, v) in enumerate(inputs):
        cache.attention(layer, q, k, v)
    cache.end_forward()


def make_inputs(cache, rng, t):
    c = cache.config
    return [[cache.from_numpy(rng.standard_normal((t, h, c.head_dim)).astype(np.float32))
             for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)] for _ in range(c.num_layers)]


def check(name, cache, rng, seq_ids, lengths, out_dir):
    inputs = make_inputs(cache, rng, int(sum(lengths)))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("kvcache_forward"):
            one_forward(cache, rng, seq_ids, lengths, inputs)
        torch.cuda.synchronize()            # outside the forward: lets the trace complete
    path = os.path.join(out_dir, f"trace_{name}.json")
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    memcpy = [e for e in events if e.get("cat") == "gpu_memcpy"]
    htod = [e for e in memcpy if "HtoD" in e.get("name", "")]
    dtoh = [e for e in memcpy if "DtoH" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = [e.get("name", "") for e in events if e.get("cat") == "cuda_runtime"]
    # count only runtime calls inside the forward's annotated window (the synchronize after it,
    # and the profiler's own at exit, are outside)
    window = next(e for e in events if e.get("name") == "kvcache_forward" and e.get("ph") == "X"
                  and e.get("cat") == "user_annotation")
    t0, t1 = window["ts"], window["ts"] + window["dur"]
    forward_runtime = [e.get("name", "") for e in events
                       if e.get("cat") == "cuda_runtime" and t0 <= e.get("ts", -1) <= t1]
    bad = [n for n in forward_runtime if n in BAD_CALLS]
    kernel_streams = sorted({e["args"].get("stream") for e in kernels})
    copy_streams = sorted({e["args"].get("stream") for e in htod})
    expected_copy_stream = cache.copy_stream.stream_id
    compute_stream = torch.cuda.current_stream().stream_id
    print(f"[{name}] HtoD memcpy: {len(htod)} on streams {copy_streams}; DtoH: {len(dtoh)}; "
          f"kernels: {len(kernels)} on streams {kernel_streams}; "
          f"bad sync calls: {bad or 'none'}; copy stream id {expected_copy_stream}, "
          f"compute stream id {compute_stream}")
    print(f"[{name}] runtime calls: " + ", ".join(
        f"{n} x{runtime.count(n)}" for n in sorted(set(runtime))))
    problems = []
    if len(htod) != 1:
        problems.append(f"expected exactly 1 HtoD memcpy, got {len(htod)}")
    if dtoh:
        problems.append(f"{len(dtoh)} DtoH copies in the forward (host sync)")
    if copy_streams and set(copy_streams) & set(kernel_streams):
        problems.append(f"the aux copy ran on a kernel stream {copy_streams}")
    if bad:
        problems.append(f"synchronising calls in the forward: {bad}")
    if not kernels:
        problems.append("no kernels recorded")
    for p in problems:
        print(f"[{name}] FAIL: {p}")
    return not problems


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    cfg = kvcache.CacheConfig(num_layers=4, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                              page_size=16, dtype="bfloat16", max_total_tokens=65536,
                              rope_mode="normal", max_batch_size=64, prefill_chunk_size=8192)
    cache = kvcache.PagedKVCache(cfg, backend="cuda")
    assert cache.backend.name == "cuda" and cache.copy_stream is not None
    rng = np.random.default_rng(0)
    ids = list(range(8))
    for s in ids:
        cache.add_sequence(s)
    # warm up: Triton compiles, allocator pools, both aux buffers
    one_forward(cache, rng, ids, [300] * 8, make_inputs(cache, rng, 2400))
    for _ in range(3):
        one_forward(cache, rng, ids, [1] * 8, make_inputs(cache, rng, 8))
    one_forward(cache, rng, ids, [33] * 8, make_inputs(cache, rng, 264))
    ok = check("decode", cache, rng, ids, [1] * 8, out_dir)
    ok &= check("prefill", cache, rng, ids, [33] * 8, out_dir)
    print("PROFILE CHECK:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
