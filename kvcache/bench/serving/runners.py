"""The serving bench's systems: (a) ``EngineRunner``, (b) ``GenerateBatchRunner``, (c)
``StaticRunner``, with ``--deterministic`` (d), the ``EngineRunner`` in deterministic mode, and
where (a) stores a quantized ``--kv-dtype`` (p), the ``EngineRunner`` with pages of the compute
dtype at the same batch; each ``run(prompts, new_tokens)`` returns the new tokens of each
prompt."""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

from ...config import KV_FORMATS

SYSTEMS = ("a", "b", "c", "d", "p")
SYSTEM_NAMES = {"a": "kvcache Engine", "b": "transformers generate_batch (paged|sdpa)",
                "c": "transformers generate (static cache)",
                "d": "kvcache Engine, deterministic=True",
                "p": "kvcache Engine, 16-bit pages (same batch)"}
ASKED = {"d": lambda args, kv_dtype: bool(getattr(args, "deterministic", False)),
         "p": lambda args, kv_dtype: kv_dtype in KV_FORMATS}
"""Systems that run only when asked, by ``ASKED[key](args, kv_dtype)``: (d) with
``--deterministic``; (p) where (a)'s ``--kv-dtype`` is a quantized format (the same Engine at
the same batch with pages of the compute dtype, interleaved with (a) round by round under
``--runs``, so that the format's gain or loss at one batch is read in one run, not across two
invocations' drift)."""


class Runner:
    """One system: ``run(prompts, new_tokens)`` returns the new tokens of each prompt."""

    name = ""

    def run(self, prompts: list, new_tokens: int) -> list:
        raise NotImplementedError

    def forget(self) -> None:
        """Drop what an earlier run left that would serve the next one (a prefix cache's
        pages), so that the timed run serves its prompts cold."""

    def phase(self, whole: bool) -> None:
        """Called before the decode-step runs (``whole`` False) and before the whole workload's
        runs (True), which may want another shape ((c) pads the whole workload to one width)."""

    def close(self) -> None:
        """Undo what the runner changed on the model (its attention implementation)."""


def mixed_graphs_arg(args) -> Optional[bool]:
    """``--mixed-graphs`` as ``Engine(mixed_graphs=...)``: True, False or None (its default)."""
    value = getattr(args, "mixed_graphs", None)
    return None if value is None else value == "on"


class EngineRunner(Runner):
    """(a): our ``Engine``, sized for the workload (``batch`` sequences per forward), its pages
    stored as ``kv_dtype`` ("auto": the compute dtype); ``compile_step``, ``mixed_graphs``: the
    Engine's."""

    def __init__(self, net, backend: str, device: str, batch: int, max_len: int,
                 rope: str = "cache", prefix_cache: bool = True, kv_dtype: str = "auto",
                 compile_step: bool = False, mixed_graphs: Optional[bool] = None,
                 deterministic: bool = False):
        from ...integrations.transformers import Engine
        page = 16
        self.engine = Engine(net, backend=backend, device=device, page_size=page,
                             max_batch_size=batch,
                             max_total_tokens=batch * (-(-max_len // page) + 2) * page, rope=rope,
                             prefix_cache=prefix_cache, kv_dtype=kv_dtype,
                             compile_step=compile_step, mixed_graphs=mixed_graphs,
                             deterministic=deterministic)
        self.engine.progress = False
        kv = "" if kv_dtype == "auto" else f", kv {kv_dtype}"
        compiled = ", compiled step" if self.engine.compiled else ""
        compiled += ", mixed graphs" if self.engine.mixed_graphs else ""
        compiled += ", deterministic" if deterministic else ""
        self.name = (f"{SYSTEM_NAMES['a']} ({self.engine.cache.backend.name}, rope={rope}{kv}"
                     f"{compiled})")

    def forget(self) -> None:
        self.engine.cache.clear_prefix_cache()

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
        _use_attention(net, "paged|sdpa")
        self.attn = net.config._attn_implementation      # what transformers made of it
        self.config = GenerationConfig
        self.sdpa = "sdpa"

    def run(self, prompts, new_tokens):
        _use_attention(self.net, self.attn)
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
    """(c): ``generate`` with a static cache, ``batch`` prompts at a time, left-padded to the
    longest prompt, the whole workload's to ``whole_width`` tokens (one static shape for the
    whole run)."""

    name = SYSTEM_NAMES["c"]

    def __init__(self, net, batch: int, compile_forward: bool,
                 whole_width: Optional[int] = None):
        self.net, self.batch, self.compile = net, batch, compile_forward
        _use_attention(net, "sdpa")
        self.whole_width = whole_width
        self.pad_to: Optional[int] = None

    def phase(self, whole: bool) -> None:
        self.pad_to = self.whole_width if whole else None

    def run(self, prompts, new_tokens):
        import torch
        _use_attention(self.net, "sdpa")
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


def _use_attention(net, name: str) -> None:
    """Switch ``net``, the model every runner shares, to attention ``name`` unless it runs that
    already: with ``--runs`` the runners take turns on it, each run in its own."""
    if net.config._attn_implementation != name:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # 5.2x deprecates the prefix 5.17 needs
            net.set_attn_implementation(name)


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
