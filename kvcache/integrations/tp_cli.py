"""``python -m kvcache.integrations.tp``'s command (``main``, launched by torchrun): tensor-parallel
greedy generation that rank 0 checks against one process; apart from ``kvcache.integrations.tp``
(which re-exports ``main`` and runs it as ``__main__``) to keep that module small."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..distributed import tp as dtp
from .transformers import torch

if TYPE_CHECKING:
    from torch.nn import Module as _TorchModule

dist = torch.distributed


def _demo_model(seed: int, layers: int):
    """A random-weight Llama built from ``seed`` (the same weights on every rank)."""
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=1024, num_hidden_layers=layers, hidden_size=256, intermediate_size=512,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


def main(argv=None) -> int:
    """``torchrun --nproc-per-node=TP -m kvcache.integrations.tp [options]``: greedy generation
    on TP ranks; rank 0 also runs the whole model on one process (TP=1) and reports whether the
    tokens are identical. Returns 1 with ``--check`` when they differ. ``--help`` lists the
    options (``--model PATH``: a transformers checkpoint, loaded whole on every rank; default
    a random-weight Llama)."""
    import argparse

    import numpy as np
    from .tp import SHARD_METHODS, shard_model   # (tp re-exports main: imported here, no cycle)
    parser = argparse.ArgumentParser(prog="python -m kvcache.integrations.tp", description=(
        "Tensor-parallel greedy generation (launch with torchrun --nproc-per-node=TP); rank 0 "
        "compares the tokens with one process running the whole model."))
    parser.add_argument("--model", help="a transformers checkpoint (default: a random-weight Llama)")
    parser.add_argument("--backend", default="auto", help="cache backend (default: auto)")
    parser.add_argument("--dtype", default=None, help="model dtype when loading --model")
    parser.add_argument("--method", default="auto", choices=SHARD_METHODS)
    parser.add_argument("--prompts", type=int, default=4, help="random prompts (default 4)")
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="layers of the random Llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="exit 1 unless tokens equal TP=1")
    args = parser.parse_args(argv)
    rank, world = dtp.init()
    device = (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
              and str(dist.get_backend()) != "gloo" else "cpu")

    def load():
        if args.model is None:
            return _demo_model(args.seed, args.layers).to(device)
        import transformers
        dtype = getattr(torch, args.dtype) if args.dtype else "auto"
        # typed as the nn.Module it is: transformers declares its .to as
        # functools.wraps(nn.Module.to), which mypy reads as the unbound (self, ...) signature
        model: _TorchModule = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        return model.to(device).eval()

    from .transformers import Engine
    model = load()
    vocab = int(model.get_output_embeddings().weight.shape[0])
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    want = None
    if rank == 0:
        whole = Engine(load(), backend=args.backend)
        want = whole.generate(prompts, max_new_tokens=args.new_tokens)
        del whole
    layout = shard_model(model, method=args.method)
    engine = Engine(model, backend=args.backend, tp=world)
    got = engine.generate(prompts, max_new_tokens=args.new_tokens)
    if rank != 0:
        return 0
    same = got == want
    cfg = engine.cache.config
    print(f"tp={world} ({layout.method} split), backend {engine.cache.backend.name!r}: each rank "
          f"caches {cfg.num_kv_heads} of {cfg.num_kv_heads * world} KV heads, computes "
          f"{cfg.num_qo_heads} of {cfg.num_qo_heads * world} query heads; {engine.stats.forwards} "
          f"forwards, every rank's plan checked each step")
    print(f"prompt 0 -> {got[0][0]}")
    print(f"tokens identical to TP=1: {'yes' if same else 'NO'}")
    if not same:
        for i, (g, w) in enumerate(zip(got, want or [])):
            if g != w:
                first = next((t for t, (a, b) in enumerate(zip(g[0], w[0])) if a != b), None)
                print(f"  prompt {i}: first difference at new token {first}")
    return 1 if args.check and not same else 0
