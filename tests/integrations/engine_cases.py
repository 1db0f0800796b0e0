"""What the transformers and the mlx-lm integration tests share: the prompt workload and the
first-step logits of an engine (neutral to the model library)."""

from __future__ import annotations

import numpy as np

VOCAB = 512
NEW_TOKENS = 64
# (lengths 5..300; prompt 7 shares the first 120 tokens of prompt 1: a shared prefix)
LENGTHS = [5, 300, 37, 128, 64, 211, 9]


def make_prompts(seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in LENGTHS]
    prompts.append(prompts[1][:120] + rng.integers(1, VOCAB, 30).tolist())
    return prompts


def logit_rows(engine) -> list:
    """Spy on ``engine``'s forwards, eager (its adapter's) and captured (its step graphs'): the
    list every logits row they return is appended to, in order, as host arrays (a graph's
    logits are a view its next replay overwrites: copied at once)."""
    rows: list = []

    def wrap(run):
        def spy(*args):
            out = run(*args)
            if len(args[-1]):                   # the rows asked for: the last argument
                rows.extend(np.array(engine.adapter.to_numpy(out)))
            return out
        return spy

    engine.adapter.forward = wrap(engine.adapter.forward)
    if engine.decode_graphs is not None:
        engine.decode_graphs.run = wrap(engine.decode_graphs.run)
    return rows


def first_step_logits(engine, prompts) -> list:
    """Each prompt's first-step logits through ``engine`` (one prompt per generate, the logits
    row seen by wrapping the adapter's forward); the adapter is restored afterwards."""
    rows: list = []
    forward = engine.adapter.forward

    def spy(cache, tokens, positions, want):
        out = forward(cache, tokens, positions, want)
        if len(want):
            rows.append(engine.adapter.to_numpy(out))
        return out

    engine.adapter.forward = spy
    result = []
    try:
        for p in prompts:               # one prompt per call: the row is that prompt's
            rows.clear()
            engine.generate([p], max_new_tokens=1)
            assert len(rows) == 1 and rows[0].shape[0] == 1
            result.append(rows[0][0])
    finally:
        engine.adapter.forward = forward
    return result
