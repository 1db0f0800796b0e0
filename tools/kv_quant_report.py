"""Quantized KV on the model families (issue 32's accuracy report): per family and format,
greedy agreement over ``--tokens`` new tokens with the cache in the compute dtype, and the
mean absolute difference of the chosen tokens' log-probabilities where the two agree.

The families are the test suite's (``tests/integrations/conftest.py``: each family's features
switched on, 2 layers, small, seeded random weights, float32), through the transformers Engine
on ``--backend`` (default: reference). Prints a Markdown table.

    python tools/kv_quant_report.py [--tokens 64] [--backend reference] [--families llama,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from conftest import FAMILIES, make_model  # noqa: E402  (the tests' families, one copy)

FORMATS = ("float8_e4m3", "int8", "int4")


def run(engine, prompts, tokens):
    out, lps = engine.generate(prompts, max_new_tokens=tokens, return_logprobs=True)
    return [o[0] for o in out], [np.asarray(lp[0], np.float64) for lp in lps]


def main(argv=None) -> int:
    from kvcache.errors import KVCacheError
    from kvcache.integrations.transformers import Engine
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--backend", default="reference")
    p.add_argument("--families", default="")
    args = p.parse_args(argv)
    families = args.families.split(",") if args.families else FAMILIES
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 200, n).tolist() for n in (37, 80)]
    print(f"| family | " + " | ".join(f"{f} agree | {f} mean abs dlogp" for f in FORMATS) + " |")
    print("|---" * (1 + 2 * len(FORMATS)) + "|")
    for family in families:
        model = make_model(family, seed=FAMILIES.index(family))
        kw = dict(backend=args.backend, max_total_tokens=1024, prefix_cache=False)
        base_t, base_lp = run(Engine(model, **kw), prompts, args.tokens)
        cells = []
        for fmt in FORMATS:
            try:
                got_t, got_lp = run(Engine(model, kv_dtype=fmt, **kw), prompts, args.tokens)
            except KVCacheError as exc:
                cells += [f"refused: {type(exc).__name__}", ""]
                continue
            agree, diffs = [], []
            for a, b, la, lb in zip(base_t, got_t, base_lp, got_lp):
                same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                agree.append(same / len(a))
                diffs.extend(np.abs(la[:same] - lb[:same]).tolist())
            cells += [f"{np.mean(agree):.2f}", f"{np.mean(diffs) if diffs else float('nan'):.4f}"]
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
