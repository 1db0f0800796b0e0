"""The demo's synthetic workload: requests, shared prefixes and speculative trees, all drawn from
one seed (so a run is reproducible token for token)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

VOCAB = 4096

# Draft trees for one round of speculative decoding: per draft step, the parent pointers of the
# nodes it appends (indices in the sequence's uncommitted tree), and the accepted leaf.
SPEC_TREES = {
    # one forward: root + 2 children + 2 grandchildren under child 0 + 1 under child 1
    "one-step": ([[-1, 0, 0, 1, 1, 2]], 4),        # accept 0 -> 1 -> 4 (3 tokens)
    # a tree grown over two draft steps (one level per step), then one commit
    "two-step": ([[-1, 0, 0], [1, 1, 2]], 3),       # accept 0 -> 1 -> 3 (3 tokens)
    # every draft rejected: only the root (the pending token) is kept
    "rejected": ([[-1, 0, 0, 0]], 0),               # accept 0 (1 token)
    # a deep chain-like tree, two tokens accepted
    "deep": ([[-1, 0, 1, 2, 0]], 2),               # accept 0 -> 1 -> 2 (3 tokens)
}


@dataclass
class SpecPlan:
    kind: str
    at: int                      # start when this many tokens have been generated (>= 1)
    levels: list                 # parent pointers per draft step
    leaf: int                    # accepted leaf (index in the uncommitted tree)
    wrong_tokens: np.ndarray     # tokens of the rejected draft nodes

    @property
    def parents(self) -> list:
        return [p for level in self.levels for p in level]

    def path(self) -> list:
        """Accepted nodes, root first."""
        parents, out, node = self.parents, [], self.leaf
        while node != -1:
            out.append(node)
            node = parents[node]
        return out[::-1]

    @property
    def accepted(self) -> int:
        return len(self.path())

    def node_tokens(self, stream: np.ndarray, generated: int) -> np.ndarray:
        """Tokens of every tree node: the root is the pending token ``stream[generated-1]``, the
        accepted path continues the stream, other nodes are wrong drafts."""
        parents = self.parents
        tokens = np.array(self.wrong_tokens[:len(parents)], dtype=np.int64)
        for depth, node in enumerate(self.path()):
            tokens[node] = stream[generated - 1 + depth]
        return tokens


@dataclass
class Prefix:
    key: str
    tokens: np.ndarray           # this prefix's own tokens (after its parent's)
    parent: Optional[str] = None


@dataclass
class Request:
    rid: int
    arrival: int                 # step at which the request arrives
    prompt: np.ndarray           # prompt tokens after the shared prefix (if any)
    output_len: int              # tokens generated per sample
    outputs: list                # per sample: (output_len,) generated tokens ("the sampler's picks")
    prefix: Optional[str] = None
    spec: Optional[SpecPlan] = None
    window: Optional[tuple] = None   # (window_size, sink_size)
    features: tuple = field(default_factory=tuple)

    @property
    def n_samples(self) -> int:
        return len(self.outputs)

    @property
    def sliding(self) -> bool:
        return self.window is not None


@dataclass
class Workload:
    requests: list
    prefixes: dict

    def prefix_chain(self, key: Optional[str]) -> list:
        """Prefixes from the root to ``key``."""
        chain = []
        while key is not None:
            chain.append(self.prefixes[key])
            key = self.prefixes[key].parent
        return chain[::-1]

    def prefix_length(self, key: Optional[str]) -> int:
        return sum(len(p.tokens) for p in self.prefix_chain(key))


def _log_uniform(rng, lo, hi) -> int:
    return int(round(np.exp(rng.uniform(np.log(lo), np.log(hi)))))


def make_workload(num_requests: int, seed: int, *, max_prompt: int = 3000,
                  max_output: int = 40, arrival_rate: float = 1.0, long_fraction: float = 0.0,
                  burst: int = 4,
                  windows: tuple = ((128, 4), (256, 16), (192, 0))) -> Workload:
    """``num_requests`` requests arriving as a Poisson process (``arrival_rate`` per step).

    Prompts are log-uniform between a few tokens and ``max_prompt / 4``; one request (plus a
    ``long_fraction`` of the plain ones) has a long prompt between ``max_prompt / 2`` and
    ``max_prompt``; windowed prompts are log-uniform up to ``max_prompt``. Outputs are 4 to
    ``max_output`` tokens, except for a burst of ``burst`` requests that arrive together and
    generate 2 samples of 3 to 4 times ``max_output`` tokens each: their growth is what fills the
    cache and makes the scheduler preempt. Some requests share a system prompt (two roots and one
    nested few-shot prefix), ask for 2-4 parallel samples, run one round of speculative decoding,
    or use a sliding window with attention sinks. The first requests are forced to cover every
    feature, so any run of ``9 + burst`` or more requests exercises all of them."""
    rng = np.random.default_rng([seed, 0xDE30])
    # shared prefixes (sizes for max_prompt=3000): a 200-600 token system prompt, a 40-200 one,
    # and 100-400 tokens of few-shot examples after the first
    unit = max_prompt / 3000

    def tokens(lo, hi):
        return rng.integers(0, VOCAB, _log_uniform(rng, max(2, lo * unit), max(3, hi * unit)))

    prefixes = {"sys-a": Prefix("sys-a", tokens(200, 600)), "sys-b": Prefix("sys-b", tokens(40, 200))}
    prefixes["sys-a+fewshot"] = Prefix("sys-a+fewshot", tokens(100, 400), parent="sys-a")
    forced = ["nested-prefix+parallel", "spec:two-step", "window", "parallel", "prefix",
              "spec:one-step", "long", "window", "spec:rejected"] + ["burst"] * burst
    rng.shuffle(forced)
    burst_at = int(0.4 * num_requests / arrival_rate)
    requests, t = [], 0.0
    for rid in range(num_requests):
        t += rng.exponential(1.0 / arrival_rate)
        if rid < len(forced):
            want = forced[rid]
        else:
            want = str(rng.choice(["plain", "plain", "plain", "prefix", "prefix", "parallel",
                                   "prefix+parallel", "spec", "window"]))
        prefix = spec = window = None
        n_samples, features = 1, []
        if "prefix" in want:
            prefix = "sys-a+fewshot" if want.startswith("nested") else str(
                rng.choice(["sys-a", "sys-b", "sys-a+fewshot"]))
            features.append("shared prefix")
        if "parallel" in want:
            n_samples = int(rng.integers(2, 5))
            features.append("parallel samples")
        if want == "window":
            window = tuple(int(x) for x in windows[int(rng.integers(len(windows)))])
            features.append("sliding window")
            prompt_len = _log_uniform(rng, 64, max(max_prompt, 128))
        elif want == "burst":
            prompt_len = int(rng.integers(max_prompt // 8, max_prompt // 4 + 1))
            n_samples = 2
            features.append("burst of long generations")
        elif want == "long" or (want == "plain" and rng.random() < long_fraction):
            prompt_len = int(rng.integers(max_prompt // 2, max_prompt + 1))
            features.append("long prompt")
        else:
            prompt_len = _log_uniform(rng, 4, max(max_prompt // 4, 8))
            if prefix is not None:
                prompt_len = max(1, prompt_len // 4)   # a question after the shared context
        output_len = int(rng.integers(4, max_output + 1))
        if want == "burst":
            output_len = int(rng.integers(3 * max_output, 4 * max_output + 1))
        if want.startswith("spec"):
            kind = want.split(":")[1] if ":" in want else str(rng.choice(list(SPEC_TREES)))
            levels, leaf = SPEC_TREES[kind]
            at = int(rng.integers(1, 4))
            output_len = max(output_len, at + 8)
            size = sum(len(level) for level in levels)
            wrong = rng.integers(0, VOCAB, size)
            spec = SpecPlan(kind, at, [list(level) for level in levels], leaf, wrong)
            features.append(f"speculative ({kind})")
        outputs = [rng.integers(0, VOCAB, output_len) for _ in range(n_samples)]
        arrival = burst_at if want == "burst" else int(t)
        requests.append(Request(rid, arrival, rng.integers(0, VOCAB, prompt_len), output_len, outputs,
                                prefix=prefix, spec=spec, window=window,
                                features=tuple(features) or ("plain",)))
    return Workload(requests, prefixes)
