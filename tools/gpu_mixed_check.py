"""Captured mixed steps on a GPU (``Engine(mixed_graphs=True)``): the same requests through an
Engine with mixed steps captured per token bucket and through one with them eager, on a
random-weight Llama (Llama-3-8B layer shapes, a few layers), prompts of 30-700 tokens arriving
over the run so prefill chunks land beside decode rows; greedy tokens and their logprobs
compared, and the forwards each engine ran as graphs. Exits 1 when a float32 token differs or
when the mixed engine ran a step eagerly.

    python tools/gpu_mixed_check.py [--layers 4] [--tiny]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    from kvcache.bench.serving.model import build_model
    from kvcache.integrations import SamplingParams
    from kvcache.integrations.transformers import Engine
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny dims, cuda CPU mode)")
    args = p.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    bad = 0
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
    for dtype in (("float32",) if args.tiny else ("float32", "bfloat16")):
        net = build_model("llama", args.layers, args.tiny, device, dtype, 0)
        rng = np.random.default_rng(2)
        prompts = [rng.integers(1, net.config.vocab_size, int(n)).tolist()
                   for n in rng.integers(30, 60 if args.tiny else 700, 24)]
        runs = {}
        for mixed in (True, False):
            eng = Engine(net, backend="cuda", device=device, page_size=16, max_batch_size=16,
                         max_total_tokens=32768, prefill_chunk_size=512, graphs=True,
                         mixed_graphs=mixed)
            eng.progress = False
            out = {}
            pending = list(enumerate(prompts))
            t0 = time.perf_counter()
            while pending or eng.has_unfinished():
                if pending:                      # one arrival per step: mixed steps throughout
                    i, prompt = pending.pop(0)
                    out[eng.add_request(prompt, greedy)] = ([], [])
                for o in eng.step():
                    out[o.request_id][0].extend(o.new_token_ids)
                    out[o.request_id][1].extend(o.logprobs or [])
            wall = time.perf_counter() - t0
            runs[mixed] = (out, eng.stats, wall)
        (m_out, m_stats, m_wall), (e_out, e_stats, e_wall) = runs[True], runs[False]
        same = sum(m_out[k][0] == e_out[k][0] for k in m_out)
        lp = [abs(a - b) for k in m_out for a, b in zip(m_out[k][1], e_out[k][1])
              if m_out[k][0] == e_out[k][0]]
        eager = m_stats.forwards - m_stats.graph_forwards
        print(f"{dtype}: tokens equal for {same} of {len(m_out)} requests; logprob |diff| max "
              f"{max(lp) if lp else float('nan'):.3g}; mixed engine {m_stats.graph_forwards}/"
              f"{m_stats.forwards} forwards as graphs ({m_stats.graph_captures} captures), "
              f"eager-mixed engine {e_stats.graph_forwards}/{e_stats.forwards}; wall "
              f"{m_wall:.2f} s vs {e_wall:.2f} s", flush=True)
        if eager or (dtype == "float32" and same != len(m_out)):
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
