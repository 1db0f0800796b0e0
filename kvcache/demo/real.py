"""``kvcache demo --model llama|qwen2|mistral|phi3|gemma|PATH``: the demo's workload on a real
model architecture through the transformers ``Engine`` (the default on a CUDA GPU: ``llama``).

Without a checkpoint the model is built from a small config of that family with random weights
(seeded); a directory is loaded with transformers (``config.json`` + safetensors, no network).
The engine runs its real path: on a GPU the cache on the model's device, whole-step decode
graphs and the host tier for preempted sequences. The check (``kvcache.demo.check``) scores a
sample of the run's samples again with the model's own forward in transformers (its own
attention, no cache): greedy tokens must be the model's argmax (up to near-ties within the
dtype's tolerance), and every token's log-probability must agree.
"""

from __future__ import annotations

import os

from . import check
from .check import CheckResult, teacher_forced_logits

__all__ = ["FAMILY_SHAPES", "build_model", "build_parser", "check_model_name", "make_engine", "replay",
           "run"]

FAMILY_SHAPES = {
    # family: (config class, model class, config fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=64, sliding_window=4096)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=192, intermediate_size=512, num_attention_heads=2,
                  num_key_value_heads=2)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=256)),
}
VOCAB = 2048


def check_model_name(name: str) -> None:
    """``--model NAME`` must be a family of ``FAMILY_SHAPES`` or a checkpoint directory (one with
    a ``config.json``): else a ``kvcache.cli_kit.UsageError`` (exit status 2) naming the choices,
    before anything is built or imported."""
    from kvcache.cli_kit import UsageError
    if name in FAMILY_SHAPES:
        return
    families = ", ".join([*FAMILY_SHAPES, "synthetic"])
    if not os.path.isdir(name):
        raise UsageError(f"--model {name!r} is neither a model family ({families}) nor a "
                         "checkpoint directory")
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise UsageError(f"--model {name!r} is a directory without a config.json, not a "
                         f"transformers checkpoint; give one, or a model family ({families})")


def build_model(name: str, seed: int, dtype: str = "float32"):
    """A transformers causal LM: a family's small random model (seeded), or a local checkpoint
    directory. Returns (model, description)."""
    from kvcache.integrations import require
    torch = require("torch", "transformers")
    transformers = require("transformers", "transformers", "5.17")
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    check_model_name(name)
    if os.path.isdir(name):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name, local_files_only=True, dtype=tdtype)
        return model.eval(), f"{model.config.model_type} checkpoint {name}"
    config_name, model_name, shape = FAMILY_SHAPES[name]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=4096,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(tdtype).eval()
    params = sum(p.numel() for p in model.parameters())
    return model, f"{name}, random weights (seed {seed}), {params / 1e6:.1f}M parameters"


def device_of(opts) -> str:
    import torch
    return opts.device or ("cuda" if torch.cuda.is_available() else "cpu")


def make_engine(opts, seed: int):
    """``(engine, model, description, dtype)`` for ``--model`` (sizes from ``opts``)."""
    from kvcache.integrations import require
    torch = require("torch", "transformers")
    from kvcache.integrations.transformers import Engine
    device = device_of(opts)
    if device == "cpu":
        torch.set_num_threads(1)     # small models: torch's thread pool costs more than it gives
    dtype = opts.dtype or ("float32" if device == "cpu" else "bfloat16")
    model, what = build_model(opts.model, seed, dtype)
    model = model.to(device)
    engine = Engine(model, backend=opts.backend, page_size=opts.page_size,
                    max_total_tokens=opts.max_total_tokens, max_batch_size=opts.max_batch_size,
                    prefill_chunk_size=opts.prefill_chunk_size, offload=opts.offload)
    return engine, model, what, dtype


def replay(model, workload, served, rids: list, dtype: str) -> CheckResult:
    """Score the samples of requests ``rids`` again with the model's own forward (one plain
    forward of prompt + generated tokens per sample, transformers' attention, no cache)."""
    return check.replay(CheckResult(dtype, "transformers (the model's own forward)"), workload,
                        served, rids,
                        lambda prompt, toks: teacher_forced_logits(model, prompt, toks))


def build_parser():
    """The demo's parser (one for every mode; kept here for callers of the real-model demo)."""
    from . import build_parser as demo_parser
    return demo_parser()


def run(opts) -> dict:
    """Run the real-model demo (``opts`` from ``build_parser``); returns a summary dict: ``ok``
    (the check passed), ``failures``, ``checked`` (samples checked), ``stats`` (the engine's
    ``EngineStats``), ``features``, ``distinct`` (distinct samples per parallel request), ..."""
    from . import run_demo
    r = run_demo(opts)
    check = r.check
    return dict(model=r.model, backend=r.backend, device=r.device, dtype=r.dtype,
                requests=len(r.workload.requests), features=r.workload.features(),
                new_tokens=r.served.new_tokens, wall=r.served.wall_s, stats=r.stats,
                failures=[] if check is None else list(check.failures),
                checked=0 if check is None else check.samples,
                check_s=0.0 if check is None else check.seconds, distinct=r.distinct(),
                pages=r.served.total_pages, ok=r.check_ok is not False, samples=opts.samples)
