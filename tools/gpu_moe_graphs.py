"""The MoE families that could not be captured as CUDA graphs in float32 (issue 51: mixtral,
qwen3_moe, gpt_oss, deepseek_v3 raised "Cannot copy between CPU and CUDA tensors during CUDA graph
capture" from ``Engine.generate``), run on a GPU through ``Engine`` with its defaults (graphs on)
in float32: the greedy tokens against transformers' own ``generate`` on the same GPU, the
warning, and how many steps ran eagerly instead of from a graph.

    python tools/gpu_moe_graphs.py [--families mixtral,qwen3_moe,gpt_oss,deepseek_v3]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))

import torch  # noqa: E402

from conftest import NEW_TOKENS, make_model, make_prompts  # noqa: E402
from kvcache.demo.check import rescore_greedy, teacher_forced_logits  # noqa: E402
from kvcache.integrations.transformers import Engine  # noqa: E402


def explain(model, prompt, got, want) -> str:
    """Where the engine's greedy tokens part from transformers' ``generate``: the first
    differing position, the teacher-forced logits' gap between the two picks there (the
    model's own forward over the common prefix, no cache), and each run's re-score verdict."""
    t = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = teacher_forced_logits(model, prompt, want[:t + 1])[t]
    top = sorted(range(len(logits)), key=lambda i: -logits[i])[:2]
    ours, theirs = (rescore_greedy(model, prompt, toks, "float32") for toks in (got, want))
    return (f"part at new token {t}: engine {got[t]}, generate {want[t]}; re-score top-2 "
            f"{top} gap {logits[top[0]] - logits[top[1]]:.3g}, engine pick - generate pick "
            f"{logits[got[t]] - logits[want[t]]:.3g}; engine re-score (near-ties, problem) "
            f"{ours}, generate re-score {theirs}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--families", default="mixtral,qwen3_moe,gpt_oss,deepseek_v3")
    a = p.parse_args()
    prompts = make_prompts()
    bad = 0
    for fam in a.families.split(","):
        model = make_model(fam).to("cuda")
        want = []
        with torch.no_grad():
            for pr in prompts:
                out = model.generate(torch.tensor([pr], device="cuda"), max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False)
                want.append(out[0, len(pr):].tolist())
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = Engine(model, backend="cuda")
            got = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        wall = time.perf_counter() - t0
        toks = [g[0] if isinstance(g[0], list) else g for g in got]
        same = sum(x == y for x, y in zip(toks, want))
        graphs = engine.decode_graphs
        names = sorted({type(w.message).__name__ for w in caught
                        if "graph" in str(w.message).lower()})
        print(f"{fam}: float32 on {torch.cuda.get_device_name(0)}, graphs "
              f"{'on' if graphs else 'off'}: {same}/{len(prompts)} prompts token-identical to "
              f"transformers' generate; captures {getattr(graphs, 'captures', 0)}, replays "
              f"{getattr(graphs, 'replays', 0)}, eager steps {getattr(graphs, 'eager_runs', 0)} "
              f"({sorted(getattr(graphs, 'eager', {}))}); graph warnings {names} "
              f"({sum('graph' in str(w.message).lower() for w in caught)}); {wall:.1f} s", flush=True)
        for pr, x, y in zip(prompts, toks, want):
            if x != y:
                print(f"  {explain(model, pr, x, y)}", flush=True)
        bad += same != len(prompts)
        del engine, model, graphs, got      # (the step graphs hold the engine's cache)
        gc.collect()
        torch.cuda.empty_cache()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
