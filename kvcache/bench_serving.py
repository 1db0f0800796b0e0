"""``kvcache bench --serving --model llama``: serving throughput side by side, in one run.

Systems, on one seeded workload and one randomly initialised model: ``a``, our
``integrations.transformers.Engine`` (continuous batching on a ``PagedKVCache``); ``b``,
transformers' continuous batching (``generate_batch``, attention ``"paged|sdpa"``); ``c``,
transformers' ``generate`` with a static cache, ``--batch`` requests at a time left-padded to the
longest prompt (one static shape). The roofline of one decode step: the bytes it must read (the
weights once, the KV of every sequence) over the device copy rate measured in the same run.

Per system:

* ``tokens_per_s``: new tokens of the whole workload over its wall time, timed on its second run
  (the first warms up: compiles, graph captures and allocations happen once per process);
* ``decode_step_ms``: one decode step at ``--batch`` sequences, as a difference: the same
  ``--batch`` prompts of ``decode_prompt`` tokens generated to ``n1`` and to ``n2`` new tokens,
  ``(wall(n2) - wall(n1)) / (n2 - n1)`` (the added steps are all decode steps of the full batch;
  no system needs instrumenting);
* ``gpu_busy``: under ``torch.profiler``, the share of the longer run's last ``wall(n2) -
  wall(n1)`` that the GPU's activity (kernels, copies, memsets; their union) covers (cuda only);
* ``same_tokens_as_a``: requests whose greedy tokens equal (a)'s.

``--tiny`` is the CI smoke run (seconds on a CPU): tiny dims and tiny work (4 requests of 8-32
tokens, 6 new tokens, 1 layer, batch 4, no profiler off the GPU); its targets are not judged.
Progress goes to stderr (``say``), a line per phase; the results to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import time
import warnings
from typing import Any, Callable, Optional

import numpy as np

SYSTEMS = ("a", "b", "c")
SYSTEM_NAMES = {"a": "kvcache Engine", "b": "transformers generate_batch (paged|sdpa)",
                "c": "transformers generate (static cache)"}
MODELS = ("llama",)

LLAMA3_8B_LAYER: dict[str, Any] = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
    vocab_size=128256)
"""Llama-3-8B's layer shapes (the bench keeps ``--layers`` of them)."""
TINY: dict[str, Any] = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
    vocab_size=512)
"""Small dims for a CPU smoke run (``--tiny``)."""

_START = time.perf_counter()
"""When the module was imported (``kvcache bench --serving`` imports it first): progress times."""
TARGET_ROOFLINE = 1.3
"""(a)'s decode step at ``--batch`` over the roofline: at most this."""
TARGET_VS_B = 10.0
"""(a)'s tokens/s over (b)'s: at least this."""
TARGET_BUSY = 0.85
"""(a)'s GPU busy fraction during decode: at least this."""


# ---------------------------------------------------------------------- workload and model
def workload(requests: int, prompt_range: tuple, vocab: int, seed: int) -> list:
    """``requests`` prompts of uniformly random length in ``prompt_range`` (inclusive) and
    uniformly random token ids in ``[1, vocab)``, from ``seed``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_range[0], prompt_range[1] + 1, size=requests)
    return [rng.integers(1, vocab, size=int(n)).tolist() for n in lengths]


def build_model(model: str, layers: int, tiny: bool, device: str, dtype: str, seed: int):
    """A randomly initialised (``seed``) ``*ForCausalLM`` of ``model``'s family with the
    Llama-3-8B layer shapes (``tiny``: ``TINY``), ``layers`` layers, in ``dtype`` on ``device``;
    no EOS token, so every request produces exactly the tokens it asks for."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: the serving bench knows {', '.join(MODELS)}")
    dims = TINY if tiny else LLAMA3_8B_LAYER
    cfg = LlamaConfig(**dims, num_hidden_layers=layers, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      eos_token_id=None, bos_token_id=None, pad_token_id=0,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            net = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    net.generation_config.eos_token_id = None
    net.generation_config.pad_token_id = 0
    return net.eval()


def decode_bytes(net, batch: int, context: float) -> dict:
    """Bytes one decode step of ``batch`` sequences of mean length ``context`` must read: every
    weight once (the input embedding only for the batch's rows) and each sequence's K and V."""
    cfg = net.config
    emb = net.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    weights += batch * emb.shape[1] * emb.element_size() - emb.numel() * emb.element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = (batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
          * emb.element_size())
    return {"weight_bytes": int(weights), "kv_bytes": int(kv)}


def copy_rate(device: str, nbytes: int = 1 << 30, repeat: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting what is read and what is written
    (``2 * nbytes`` per copy), best of ``repeat`` copies of ``nbytes``."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat + 2):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _sync(device: str) -> None:
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- the systems
class Runner:
    """One system: ``run(prompts, new_tokens)`` returns the new tokens of each prompt."""

    name = ""

    def run(self, prompts: list, new_tokens: int) -> list:
        raise NotImplementedError

    def close(self) -> None:
        """Undo what the runner changed on the model (its attention implementation)."""


class EngineRunner(Runner):
    """(a): our ``Engine``, sized for the workload (``batch`` sequences per forward)."""

    def __init__(self, net, backend: str, device: str, batch: int, max_len: int,
                 rope: str = "cache"):
        from .integrations.transformers import Engine
        page = 16
        self.engine = Engine(net, backend=backend, device=device, page_size=page,
                             max_batch_size=batch,
                             max_total_tokens=batch * (-(-max_len // page) + 2) * page, rope=rope)
        self.engine.progress = False
        self.name = f"{SYSTEM_NAMES['a']} ({self.engine.cache.backend.name}, rope={rope})"

    def run(self, prompts, new_tokens):
        out = self.engine.generate(prompts, max_new_tokens=new_tokens)
        return [o[0] for o in out]


class GenerateBatchRunner(Runner):
    """(b): transformers' continuous batching."""

    name = SYSTEM_NAMES["b"]

    def __init__(self, net, cb_config: Optional[dict] = None):
        from transformers import GenerationConfig
        self.net = net
        self.cb = None
        if cb_config:
            # off the GPU transformers sizes its cache from the host's free memory (minutes of
            # zero-filling); there the bench gives it the workload's size
            import dataclasses as dc
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
            fields = {f.name for f in dc.fields(ContinuousBatchingConfig)}
            if "page_size" in fields and "block_size" in cb_config:      # renamed in 5.17
                cb_config = dict(cb_config, page_size=cb_config.pop("block_size"))
            self.cb = ContinuousBatchingConfig(**cb_config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # 5.2x deprecates the prefix 5.17 needs
            net.set_attn_implementation("paged|sdpa")
        self.config = GenerationConfig
        self.sdpa = "sdpa"

    def run(self, prompts, new_tokens):
        cfg = self.config(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
        # no inference_mode: the manager's own thread updates tensors made here in place
        with _quiet_transformers():
            kw = {} if self.cb is None else {"continuous_batching_config": self.cb}
            out = self.net.generate_batch(prompts, generation_config=cfg, progress_bar=False, **kw)
        # request ids are "req_<index>", in the order of the prompts
        keys = sorted(out, key=lambda k: int(str(k).rsplit("_", 1)[-1]))
        return [list(out[k].generated_tokens) for k in keys]

    def close(self):
        self.net.set_attn_implementation(self.sdpa)


class StaticRunner(Runner):
    """(c): ``generate`` with a static cache, ``batch`` prompts at a time, left-padded to
    ``pad_to`` tokens (one static shape for the whole run)."""

    name = SYSTEM_NAMES["c"]

    def __init__(self, net, batch: int, compile_forward: bool):
        self.net, self.batch, self.compile = net, batch, compile_forward
        self.net.set_attn_implementation("sdpa")
        self.pad_to: Optional[int] = None

    def run(self, prompts, new_tokens):
        import torch
        dev = next(self.net.parameters()).device
        out = []
        width = self.pad_to or max(len(p) for p in prompts)
        for i in range(0, len(prompts), self.batch):
            group = prompts[i:i + self.batch]
            ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            with torch.inference_mode(), _quiet_transformers():
                gen = self.net.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                        do_sample=False, cache_implementation="static",
                                        eos_token_id=None, pad_token_id=0,
                                        disable_compile=not self.compile)
            out.extend(gen[:, width:].tolist())
        return out


@contextlib.contextmanager
def _quiet_transformers():
    import logging
    saved = [(lg, lg.level) for lg in map(logging.getLogger, ("transformers",
                                                              "ContinuousBatchingLogger"))]
    try:
        for lg, _ in saved:
            lg.setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


# ---------------------------------------------------------------------- measurements
def _timed(fn: Callable, device: str):
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - t0, result


def _gpu_spans(fn: Callable, device: str) -> tuple:
    """(wall s, [(start us, end us)] of the GPU's activity: kernels, copies, memsets) of
    ``fn()`` under ``torch.profiler`` (GPU activity only: recording host ops would slow the host
    and understate the busy fraction)."""
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall, _ = _timed(fn, device)
    return wall, [(e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type.name == "CUDA"]


def union_length(spans) -> float:
    """Total length covered by the intervals ``spans`` ((start, end) pairs), overlaps once."""
    busy, end = 0.0, -float("inf")
    for s, t in sorted(spans):
        if t <= end:
            continue
        busy += t - max(s, end)
        end = t
    return busy


def tail_busy(spans, window: float) -> Optional[float]:
    """The fraction of the last ``window`` (same unit as ``spans``) before the end of the last
    span that ``spans`` cover; None without spans or window."""
    if not spans or window <= 0:
        return None
    lo = max(t for _, t in spans) - window
    return union_length([(max(s, lo), t) for s, t in spans if t > lo]) / window


def measure(runner: Runner, prompts: list, new_tokens: int, decode_prompts: list, n1: int,
            n2: int, device: str, profile_busy: bool,
            before_whole: Optional[Callable] = None, say: Callable = lambda msg: None) -> tuple:
    """Warm up, time the decode difference (and profile it), then (after ``before_whole()``)
    time the whole run; checks every request produced its tokens. Returns (the system's row,
    the timed whole run's tokens); ``say(phase)`` before each phase."""
    # warm-up (compiles, graph captures) at n2: at n1 (1 with --tiny: prefill only) the timed
    # wall(n2) paid the first decode steps' one-time costs
    say(f"decode warm-up (B={len(decode_prompts)}, {n2} tokens)")
    runner.run(decode_prompts, n2)
    walls = {}
    for n in (n1, n2):
        say(f"decode timed to {n} tokens")
        walls[n], out = _timed(lambda: runner.run(decode_prompts, n), device)
        _check(runner, out, len(decode_prompts), n)
    step = (walls[n2] - walls[n1]) / (n2 - n1)
    busy = None
    if profile_busy:
        # busy over the last (n2 - n1) steps of one profiled run (their length: the difference
        # of two profiled runs), never over 100% (a difference of two busy totals read 172%);
        # the throwaway first run pays CUPTI's start-up
        say("gpu busy (torch.profiler, 3 runs)")
        _gpu_spans(lambda: runner.run(decode_prompts, n1), device)
        w1, _ = _gpu_spans(lambda: runner.run(decode_prompts, n1), device)
        w2, spans = _gpu_spans(lambda: runner.run(decode_prompts, n2), device)
        busy = tail_busy(spans, (w2 - w1) * 1e6)
    if before_whole is not None:
        before_whole()
    # the whole workload once untimed: every system meets its batch sizes, prompt lengths and
    # chunk shapes here first (compiles, graph captures, allocator growth), so the timed run
    # is its steady state (one-time costs were 54% of (a)'s first run on the H100)
    say(f"whole workload warm-up ({len(prompts)} requests x {new_tokens} tokens)")
    runner.run(prompts, new_tokens)
    say("whole workload timed")
    wall, out = _timed(lambda: runner.run(prompts, new_tokens), device)
    tokens = _check(runner, out, len(prompts), new_tokens)
    return {"system": runner.name, "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "decode_step_ms": step * 1e3,
            "decode_walls_s": {str(k): v for k, v in walls.items()}, "gpu_busy": busy}, out


def _check(runner, out, requests: int, new_tokens: int) -> int:
    lengths = [len(o) for o in out]
    if len(out) != requests or any(n != new_tokens for n in lengths):
        raise RuntimeError(f"{runner.name}: expected {requests} requests of {new_tokens} new "
                           f"tokens, got {len(out)} requests of lengths {sorted(set(lengths))}")
    return sum(lengths)


# ---------------------------------------------------------------------- the command
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serving bench's options (on ``kvcache bench``'s parser)."""
    g = p.add_argument_group("serving bench (--serving)")
    g.add_argument("--serving", action="store_true",
                   help="serving throughput side by side: (a) the kvcache Engine, (b) "
                        "transformers generate_batch, (c) transformers static-cache generate, and "
                        "the decode-step roofline (needs torch and transformers)")
    g.add_argument("--model", default="llama", choices=MODELS,
                   help="the random-weight model's family (default llama: Llama-3-8B shapes)")
    g.add_argument("--requests", type=_pos, default=None, metavar="N",
                   help="requests in the whole run (default 256; --tiny: 4)")
    g.add_argument("--new-tokens", type=_pos, default=None, metavar="N",
                   help="new tokens per request (default 128; --tiny: 6)")
    g.add_argument("--layers", type=_pos, default=None, metavar="N",
                   help="decoder layers of the model (default 8; --tiny: 1)")
    g.add_argument("--batch", type=_pos, default=None, metavar="N",
                   help="sequences per forward for (a), batch for (c) and the decode-step "
                        "measurement (default 64; --tiny: 4)")
    g.add_argument("--tiny", action="store_true",
                   help="a smoke run of seconds on a CPU (CI runs it): small dims, prompts and "
                        "work (the sizes above shrink unless given; no profiler off the GPU); "
                        "its targets are not judged")
    g.add_argument("--rope", default="cache", choices=("model", "cache"),
                   help="who rotates q and k in (a): the cache's fused RoPE append (default, "
                        "Engine(rope='cache')) or the model's own rotary (rope='model')")
    g.add_argument("--skip", default="", metavar="LIST",
                   help="systems to skip, comma separated from a,b,c (e.g. --skip b,c)")
    g.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the weights and the workload (default 0)")
    g.add_argument("--no-busy", action="store_true", help="skip the profiled runs that "
                   "measure the GPU busy fraction (a third of the run time; never off the GPU)")
    g.add_argument("--static-compile", action="store_true",
                   help="let (c) compile its forward (transformers' auto-compile; off by default)")


def _pos(text: str) -> int:
    from .bench import _positive_int
    return _positive_int(text)


def check_device(device: Optional[str]) -> None:
    """Raise ``UsageError`` at once when torch or transformers is missing or ``device`` (None:
    cuda when there is one, else cpu) is a GPU torch cannot reach."""
    from .cli import UsageError
    say("loading torch and transformers")
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--serving needs torch and transformers: {exc}") from None
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: torch {torch.__version__} sees no CUDA GPU here; "
                         f"use --device cpu (with --tiny for a smoke run)")


def say(msg: str) -> None:
    """A progress line on stderr with the seconds since the bench started (a long run is never a
    silent terminal; the results go to stdout)."""
    print(f"kvcache bench --serving [{time.perf_counter() - _START:5.1f} s] {msg}",
          file=sys.stderr, flush=True)


def parse_skip(text: str) -> set:
    skip = {s.strip() for s in text.split(",") if s.strip()}
    bad = skip - set(SYSTEMS)
    if bad:
        raise ValueError(f"--skip {text!r}: unknown system(s) {', '.join(sorted(bad))}; "
                         f"choose from {', '.join(SYSTEMS)}")
    return skip


SIZES = {"requests": (256, 4), "new_tokens": (128, 6), "layers": (8, 1), "batch": (64, 4)}
"""Option: (default, default with --tiny)."""


def run(args) -> dict:
    """Run the serving bench for parsed ``args``; returns the JSON-ready result."""
    import torch
    import transformers
    for name, (full, tiny) in SIZES.items():
        if getattr(args, name, None) is None:
            setattr(args, name, tiny if args.tiny else full)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    skip = parse_skip(args.skip)
    dtype = "bfloat16" if on_gpu else "float32"
    backend = args.backend or ("cuda" if on_gpu else "reference")
    prompt_range = (8, 32) if args.tiny else (128, 1024)
    decode_prompt = 16 if args.tiny else 512
    n2 = args.new_tokens
    n1 = max(1, n2 // 4)
    if n2 <= n1:
        raise ValueError(f"--new-tokens {n2}: the decode-step difference needs at least 2")
    say(f"building the model ({args.model}, {args.layers} layers, "
        f"{'tiny dims' if args.tiny else 'Llama-3-8B layer shapes'}, {dtype} on {device})")
    net = build_model(args.model, args.layers, args.tiny, device, dtype, args.seed)
    vocab = net.config.vocab_size
    prompts = workload(args.requests, prompt_range, vocab, args.seed)
    decode_prompts = workload(args.batch, (decode_prompt, decode_prompt), vocab, args.seed + 1)
    max_len = max(prompt_range[1], decode_prompt) + n2
    say("measuring the device copy rate (the roofline's)")
    rate = copy_rate(device, nbytes=(1 << 30) if on_gpu else (1 << 24))
    # the added steps make tokens n1+1..n2; the one making token k reads prompt + k - 1 tokens
    context = decode_prompt + (n1 + n2 - 1) / 2
    nbytes = decode_bytes(net, args.batch, context)
    roof_s = (nbytes["weight_bytes"] + nbytes["kv_bytes"]) / rate
    result: dict[str, Any] = {
        "command": "kvcache bench --serving", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.node(), "device": (torch.cuda.get_device_name(device) if on_gpu
                                               else platform.processor() or platform.machine()),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "workload": {"model": args.model, "tiny": bool(args.tiny), "layers": args.layers,
                     "dtype": dtype, "requests": args.requests, "prompt_range": list(prompt_range),
                     "new_tokens": n2, "seed": args.seed, "batch": args.batch,
                     "decode_prompt": decode_prompt, "decode_n1": n1, "decode_n2": n2,
                     "a_rope": args.rope},
        "roofline": {"copy_rate_Bps": rate, "context": context, **nbytes,
                     "decode_step_ms": roof_s * 1e3, "tokens_per_s": args.batch / roof_s},
        "systems": {}, "skipped": {}, "ratios": {},
    }
    a_out: Optional[list] = None
    for key in SYSTEMS:
        if key in skip:
            result["skipped"][key] = "--skip"
            continue
        runner: Optional[Runner] = None
        say(f"({key}) {SYSTEM_NAMES[key]}: starting")
        try:
            if key == "a":
                runner = EngineRunner(net, backend, device, args.batch, max_len, args.rope)
            elif key == "b":
                runner = GenerateBatchRunner(net, None if on_gpu else {
                    "num_blocks": -(-args.batch * max_len // 32) + 8, "block_size": 32,
                    "max_batch_tokens": 256})
            else:
                runner = StaticRunner(net, args.batch, args.static_compile)
            # (c): the decode measurement at its own width, the whole run at the longest prompt's
            static = runner
            before = (lambda: setattr(static, "pad_to", prompt_range[1])) if key == "c" else None
            t0 = time.perf_counter()
            r, out = measure(runner, prompts, n2, decode_prompts, n1, n2, device,
                             on_gpu and not args.no_busy, before,
                             lambda msg: say(f"({key}) {msg}"))
            say(f"({key}) done in {time.perf_counter() - t0:.1f} s: "
                f"{r['tokens_per_s']:.1f} tokens/s")
            a_out = out if key == "a" else a_out
            if key != "a" and a_out is not None:    # a count, not a verdict: bf16 on a GPU
                r["same_tokens_as_a"] = sum(x == y for x, y in zip(out, a_out))  # may part on ties
            if not on_gpu or args.no_busy:
                r["gpu_busy_note"] = "not measured: " + ("no GPU" if not on_gpu else "--no-busy")
            result["systems"][key] = r
        except Exception as exc:        # a peer that cannot run here is reported, not hidden
            if key == "a":
                raise
            result["skipped"][key] = f"failed: {type(exc).__name__}: {exc}"[:300]
            say(f"({key}) {result['skipped'][key]}")
        finally:
            if runner is not None:
                runner.close()
            # the next system sizes itself from the free memory: give back this one's cache
            runner = None
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    a, b = result["systems"].get("a"), result["systems"].get("b")
    if a is not None:
        result["ratios"]["a_decode_step_over_roofline"] = a["decode_step_ms"] / (roof_s * 1e3)
        result["ratios"]["a_gpu_busy"] = a["gpu_busy"]
        if b is not None:
            result["ratios"]["a_over_b_tokens_per_s"] = a["tokens_per_s"] / b["tokens_per_s"]
    return result


def print_result(res: dict) -> None:
    w, roof = res["workload"], res["roofline"]
    print(f"kvcache bench --serving --model {w['model']}: {res['device']}, {res['date']}, "
          f"torch {res['torch']}, transformers {res['transformers']}")
    print(f"  workload: {w['requests']} requests, prompts {w['prompt_range'][0]}-"
          f"{w['prompt_range'][1]} tokens, {w['new_tokens']} new tokens each, {w['layers']} layers"
          f"{' (tiny dims)' if w['tiny'] else ' (Llama-3-8B layer shapes)'}, {w['dtype']}, "
          f"seed {w['seed']}")
    print(f"  decode step: B={w['batch']}, prompt {w['decode_prompt']}, (wall to "
          f"{w['decode_n2']} tokens - wall to {w['decode_n1']}) / {w['decode_n2'] - w['decode_n1']}"
          f"; gpu busy: kernel time / wall over the same steps (torch.profiler)")
    print(f"{'system':<48} {'tokens/s':>10} {'wall s':>8} {'decode step ms':>15} {'gpu busy':>9}")
    for key in SYSTEMS:
        r = res["systems"].get(key)
        if r is None:
            print(f"({key}) {SYSTEM_NAMES[key]:<44} skipped: {res['skipped'].get(key)}")
            continue
        busy = "n/a" if r["gpu_busy"] is None else f"{r['gpu_busy'] * 100:.0f}%"
        step = r["decode_step_ms"]      # a difference of two walls: noise can make it negative
        step_text = f"{step:.3f}" if step > 0 else "<0 (noise)"
        print(f"({key}) {r['system']:<44} {r['tokens_per_s']:>10.1f} {r['wall_s']:>8.2f} "
              f"{step_text:>15} {busy:>9}")
    print(f"(roofline) weights {roof['weight_bytes'] / 1e9:.3f} GB + KV "
          f"{roof['kv_bytes'] / 1e9:.3f} GB at {roof['copy_rate_Bps'] / 1e12:.3f} TB/s copy rate: "
          f"{roof['decode_step_ms']:>.3f} ms/step, {roof['tokens_per_s']:.0f} tokens/s at "
          f"B={w['batch']}")
    same = [f"({k}) {r['same_tokens_as_a']}/{w['requests']}" for k, r in res["systems"].items()
            if "same_tokens_as_a" in r]
    if same:
        print(f"requests whose greedy tokens equal (a)'s: {', '.join(same)}")
    if w["tiny"]:
        print(f"targets: not judged on a --tiny smoke run (tiny dims on the host: "
              f"{w['decode_n2'] - w['decode_n1']} decode steps of a tiny model sit inside the "
              f"run-to-run noise; the targets are set for the full workload on a GPU)")
        return
    rt, a = res["ratios"], res["systems"].get("a", {})
    print("targets (ratios; met when the comparison holds):")
    for label, x, op, target, skipped in (
            (f"decode step / roofline at B={w['batch']}", rt.get("a_decode_step_over_roofline"),
             "<=", TARGET_ROOFLINE, "(a) skipped"),
            ("/ (b) tokens/s", rt.get("a_over_b_tokens_per_s"), ">=", TARGET_VS_B, "(b) skipped"),
            ("gpu busy during decode", rt.get("a_gpu_busy"), ">=", TARGET_BUSY,
             a.get("gpu_busy_note", "(a) skipped"))):
        if x is None:
            print(f"  (a) {label}: n/a ({skipped})")
            continue
        met = x <= target if op == "<=" else x >= target
        print(f"  (a) {label}: {x:.2f} (target {op} {target}) {'met' if met else 'MISSED'}")


def main(args) -> int:
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_result(res)
    return 0
