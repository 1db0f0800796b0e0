"""``python -m kvcache.integrations.tp``'s command (``main``, launched by torchrun): tensor-parallel
greedy generation that rank 0 checks against one process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...distributed import tp as dtp
from ..transformers import torch

if TYPE_CHECKING:
    from torch.nn import Module as _TorchModule

dist = torch.distributed


SHAPES: dict[str, tuple[dict[str, Any], int]] = {
    # name: (LlamaConfig fields, default layers)
    "small": (dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, initializer_range=0.1), 2),
    "8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                initializer_range=0.02, rope_theta=500000.0), 32),
}
"""The random-weight Llamas of ``--shape``: a small one (CPU tests), and Llama-3-8B's shapes."""


def _demo_model(seed: int, layers: int, shape: str = "small", dtype: str = "float32",
                device: str = "cpu"):
    """A random-weight Llama built from ``seed`` on ``device`` (the same weights on every rank:
    the same seed, the same kind of device)."""
    import transformers
    fields, _ = SHAPES[shape]
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, max_position_embeddings=2048, bos_token_id=None,
        eos_token_id=None, pad_token_id=0, tie_word_embeddings=False, **fields)
    torch.manual_seed(seed)
    with torch.device(device):       # a GPU draws the 8B shape's weights in a second
        model = transformers.LlamaForCausalLM(config)
    return model.to(getattr(torch, dtype)).eval()


def main(argv=None) -> int:
    """``torchrun --nproc-per-node=TP -m kvcache.integrations.tp [options]``: greedy generation
    on TP ranks; rank 0 also runs the whole model on one process (TP=1) and reports whether the
    tokens are identical. In float32 ``--check`` asks for identical tokens (exit 1 otherwise);
    in a 16-bit dtype, where one rounding may flip a near-tie, a request whose tokens differ is
    judged by a teacher-forced re-score on the whole model: every TP token must be its argmax
    or within the dtype's near-tie margin (``kvcache.demo.check.judge_greedy``), and the report
    says how many were. ``--help`` lists the options (``--model PATH``: a transformers
    checkpoint, loaded whole on every rank; default a random-weight Llama of ``--shape``)."""
    try:
        return _main(argv)
    finally:
        # every group torn down before the interpreter exits: a rank done before the others
        # (rank 1 returns while rank 0 still reports) otherwise died in the process group's
        # threads at exit ("terminate called without an active exception", SIGABRT)
        import gc

        import torch
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            # on two H200s both ranks hung here after the report (the CUDA graphs that captured
            # the model's all-reduces, still alive, the likely holders of the NCCL
            # communicator): collect them, drain the device, every rank done, then tear down
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            dist.barrier()
            dist.destroy_process_group()


def _main(argv) -> int:
    import argparse
    import gc
    import time

    from ...demo.check import rescore_greedy
    from ..transformers.tp import SHARD_METHODS, shard_model
    parser = argparse.ArgumentParser(prog="python -m kvcache.integrations.tp", description=(
        "Tensor-parallel greedy generation (launch with torchrun --nproc-per-node=TP); rank 0 "
        "compares the tokens with one process running the whole model."))
    parser.add_argument("--model", help="a transformers checkpoint (default: a random-weight Llama)")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES),
                        help="the random Llama's shape: small (default) or 8b (Llama-3-8B's)")
    parser.add_argument("--backend", default="auto", help="cache backend (default: auto)")
    parser.add_argument("--dtype", default=None,
                        help="model dtype (default: float32 for the random Llama, the "
                             "checkpoint's own for --model)")
    parser.add_argument("--method", default="auto", choices=SHARD_METHODS)
    parser.add_argument("--prompts", type=int, default=4, help="random prompts (default 4)")
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the random Llama (default: 2 small, 32 8b)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-graphs", action="store_true",
                        help="run every step eagerly (default: whole-step graphs on a GPU)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless tokens equal TP=1 (16-bit: or pass the re-score)")
    args = parser.parse_args(argv)
    rank, world = dtp.init()
    device = (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
              and str(dist.get_backend()) != "gloo" else "cpu")
    layers = args.layers if args.layers is not None else SHAPES[args.shape][1]

    def load():
        if args.model is None:
            return _demo_model(args.seed, layers, args.shape, args.dtype or "float32", device)
        import transformers
        dtype = getattr(torch, args.dtype) if args.dtype else "auto"
        # typed as the nn.Module it is: transformers declares its .to as
        # functools.wraps(nn.Module.to), which mypy reads as the unbound (self, ...) signature
        model: _TorchModule = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        return model.to(device).eval()

    from ..transformers import Engine
    want = None
    whole: Any = None
    if rank == 0:              # TP=1 first: its engine's pages are free again before TP's
        whole = load()
        one = Engine(whole, backend=args.backend, graphs=False if args.no_graphs else None)
        vocab = int(whole.get_output_embeddings().weight.shape[0])
        prompts = _prompts(args, vocab)
        t0 = time.perf_counter()
        want = one.generate(prompts, max_new_tokens=args.new_tokens)
        one_s = time.perf_counter() - t0
        del one                 # its pages are free now; the collect covers what a cycle holds
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    model = load()
    if rank != 0:
        prompts = _prompts(args, int(model.get_output_embeddings().weight.shape[0]))
    layout = shard_model(model, method=args.method)
    engine = Engine(model, backend=args.backend, tp=world,
                    graphs=False if args.no_graphs else None)
    t0 = time.perf_counter()
    got = engine.generate(prompts, max_new_tokens=args.new_tokens)
    tp_s = time.perf_counter() - t0
    if rank != 0:
        return 0
    cfg = engine.cache.config
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    print(f"tp={world} ({layout.method} split), backend {engine.cache.backend.name!r}, {dtype}, "
          f"{layers} layers: each rank caches {cfg.num_kv_heads} of {cfg.num_kv_heads * world} "
          f"KV heads, computes {cfg.num_qo_heads} of {cfg.num_qo_heads * world} query heads; "
          f"{engine.stats.forwards} forwards, every rank's plan checked each step; generate "
          f"{tp_s:.2f} s (TP=1 {one_s:.2f} s, graphs {'on' if engine.graphs else 'off'} under TP)")
    print(f"prompt 0 -> {got[0][0]}")
    same = [g == w for g, w in zip(got, want or [])]
    print(f"tokens identical to TP=1: {'yes' if all(same) else 'NO'} ({sum(same)} of {len(same)} "
          f"prompts)")
    judged_ok = True
    for i, (g, w) in enumerate(zip(got, want or [])):
        if g == w:
            continue
        first = next((t for t, (a, b) in enumerate(zip(g[0], w[0])) if a != b), None)
        ties, problem = rescore_greedy(whole, prompts[i], g[0], dtype)   # on the whole model
        judged_ok &= problem is None
        print(f"  prompt {i}: first difference at new token {first}; teacher-forced re-score on "
              f"TP=1: {problem or f'every TP token its argmax or a near-tie ({ties} near-ties)'}")
    ok = all(same) or (dtype != "float32" and judged_ok)
    if not all(same):
        print(f"judged: {'PASSED' if ok else 'FAILED'} ({'16-bit: near-ties accepted by the re-score' if dtype != 'float32' else 'float32 asks for identical tokens'})")
    return 1 if args.check and not ok else 0


def _prompts(args, vocab: int) -> list:
    rng = np.random.default_rng(args.seed)
    return [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]


if __name__ == "__main__":
    import sys

    sys.exit(main())
