"""Prefix caching on a GPU (issue 31): warm equals cold, bit for bit, through the Engine.

For each dtype and overlap mode, on a random-weight Llama (Llama-3-8B layer shapes, a few
layers): a cold engine runs ``system + question`` with its first prefill chunk ending at the
page boundary after the system prompt (docs/prefix-caching.md's condition); a warm engine first
serves ``system + other`` (leaving the system prompt's pages cached), then the same request. Every
logits row the adapter returns (prefill and each decode step, whole-step graphs on) is compared
bitwise; then the same prompts through one engine with the prefix cache on and off, as a
multi-turn conversation, counting equal greedy tokens. Prints one line per case; exits 1 when a
warm row differs from its cold row.

    python tools/gpu_prefix_check.py [--layers 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from engine_cases import logit_rows as rows_of  # noqa: E402  (the tests' spy, one copy)


def main(argv=None) -> int:
    import torch
    from kvcache.bench.serving.model import build_model
    from kvcache.integrations import SamplingParams
    from kvcache.integrations.transformers import Engine
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke run of this script "
                   "(tiny dims, reference backend)")
    args = p.parse_args(argv)
    device, backend = ("cpu", "reference") if args.tiny else ("cuda", "cuda")
    page, bad = 16, 0
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for dtype in (("float32",) if args.tiny else ("bfloat16", "float32")):
        net = build_model("llama", args.layers, args.tiny, device, dtype, 0)
        vocab = net.config.vocab_size
        rng = np.random.default_rng(1)
        system = rng.integers(1, vocab, 2000 // page * page).tolist()
        question, other = rng.integers(1, vocab, 37).tolist(), rng.integers(1, vocab, 41).tolist()
        for overlap in (True, False):
            kw = dict(backend=backend, page_size=page, max_total_tokens=16384, max_batch_size=8,
                      prefill_chunk_size=len(system), overlap=overlap)
            cold = Engine(net, **kw)
            cold_rows = rows_of(cold)
            want, want_lp = cold.generate([system + question], greedy, return_logprobs=True)
            warm = Engine(net, **kw)
            warm.generate([system + other], greedy)
            warm_rows = rows_of(warm)
            got, got_lp = warm.generate([system + question], greedy, return_logprobs=True)
            diff = [i for i, (a, b) in enumerate(zip(cold_rows, warm_rows))
                    if not np.array_equal(a, b)]
            ok = (len(cold_rows) == len(warm_rows) and not diff and got == want and got_lp == want_lp
                  and warm.stats.prefix_hit_tokens == len(system)
                  and (warm.graphs or args.tiny))
            bad += not ok
            print(f"warm=cold {dtype:<8} overlap={overlap!s:<5} graphs={warm.graphs}: "
                  f"{len(cold_rows)} logits rows, {len(diff)} differ"
                  f"{' (first ' + str(diff[0]) + ')' if diff else ''}; tokens "
                  f"{'equal' if got == want else 'DIFFER'}, their {len(want_lp[0][0])} logprobs "
                  f"{'bit-identical' if got_lp == want_lp else 'DIFFER'}; hit {warm.stats.prefix_hit_tokens} "
                  f"tokens -> {'ok' if ok else 'FAIL'}", flush=True)
            del cold, warm
            if not args.tiny:
                torch.cuda.empty_cache()
        # a conversation: the cache on and off (greedy tokens; bf16 GEMMs of other row counts
        # may part them on near-ties: counted, not judged)
        convs = [rng.integers(1, vocab, n).tolist() for n in (300, 517, 1024, 77)]
        engines = {on: Engine(net, backend=backend, page_size=page, max_total_tokens=32768,
                              max_batch_size=8, prefix_cache=on) for on in (True, False)}
        same = total = 0
        for turn in range(4):
            outs = {on: e.generate(convs, greedy) for on, e in engines.items()}
            same += sum(a == b for a, b in zip(outs[True], outs[False]))
            total += len(convs)
            convs = [c + a + rng.integers(1, vocab, 20).tolist()
                     for c, (a,) in zip(convs, outs[True])]
        s = engines[True].stats
        print(f"multi-turn {dtype}: {same}/{total} requests with equal tokens on/off; prefix "
              f"hit {s.prefix_hit_tokens} tokens, rate {s.prefix_hit_rate:.3f}", flush=True)
        del engines, net
        if not args.tiny:
            torch.cuda.empty_cache()
    print("warm=cold:", "all bit-identical" if not bad else f"{bad} case(s) FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
