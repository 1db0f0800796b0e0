"""The transformers Engine on tensor-parallel ranks: ``shard_model`` (who splits the model, how),
``tp_layout`` and ``TPLayout`` (how a model is split), and ``TensorParallelAdapter`` (the
``TransformersAdapter`` of one rank, its every step checked against the other ranks').
Published, with the whole story and the ``python -m`` command, as ``kvcache.integrations.tp``."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import weakref
from typing import Any, Optional

import numpy as np

from ...config import CacheConfig
from ...distributed import tp as dtp
from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from ..engine import PendingPicks
from .adapter import TransformersAdapter
from .model import head_dims

torch = require("torch", "transformers")
dist = torch.distributed

__all__ = ["SHARD_METHODS", "TPLayout", "TensorParallelAdapter", "shard_model", "tp_layout"]

SHARD_METHODS = ("auto", "transformers", "integration")
"""Who splits a model over the ranks: see ``kvcache.integrations.tp``."""

# plan styles whose module computes its whole output on every rank: the integration keeps it whole
_WHOLE = ("colwise_gather_output", "colwise_rep", "embedding_rowwise", "embedding_colwise",
          "rowwise_split_input", "rowwise_rep", "replicate")


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How a model is split over tensor-parallel ranks (``tp_layout(model)``)."""

    tp: int
    """Ranks in the group."""
    rank: int
    """This process's rank in the group."""
    group: Any
    """The torch.distributed process group (None: the default group)."""
    method: str
    """``"transformers"`` or ``"integration"`` (see ``kvcache.integrations.tp``); ``"none"`` on a
    group of one rank (nothing is split)."""
    num_qo_heads: int
    """Query heads this rank computes (the model's ``num_attention_heads / tp``)."""
    num_kv_heads: int
    """KV heads this rank computes and caches (``num_key_value_heads / tp``)."""


_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _local(weight):
    """A parameter's local tensor (a DTensor's shard on this rank)."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if callable(to_local) else weight


def _attention_modules(model) -> list:
    return [m for m in model.modules()
            if getattr(m, "layer_idx", None) is not None and hasattr(m, "k_proj")
            and hasattr(m, "q_proj")]


def _measured_heads(model) -> tuple:
    """(query heads, KV heads) the model's attention layers compute on this rank, from their
    projections' local weights."""
    head_dim = head_dims(model.config)[0]
    seen = {(int(_local(m.q_proj.weight).shape[0]) // head_dim,
             int(_local(m.k_proj.weight).shape[0]) // head_dim) for m in _attention_modules(model)}
    if len(seen) != 1:
        raise UnsupportedFeatureError(
            f"the {model.config.model_type} model's attention layers hold different head counts "
            f"{sorted(seen)} on this rank (or it has no q_proj/k_proj layers to split)")
    return seen.pop()


def _model_heads(model) -> tuple:
    config = model.config
    heads = int(config.num_attention_heads)
    return heads, int(getattr(config, "num_key_value_heads", None) or heads)


def tp_layout(model) -> Optional[TPLayout]:
    """How ``model`` is split over tensor-parallel ranks: by ``shard_model``, or by transformers
    (``from_pretrained(..., tp_plan="auto")``, ``model.tp_size > 1``); None when it is whole."""
    layout = _LAYOUTS.get(model)
    if layout is not None:
        return layout
    size = getattr(model, "tp_size", None)
    if not isinstance(size, int) or size <= 1:
        return None
    mods = _attention_modules(model)
    mesh = getattr(mods[0].k_proj.weight, "device_mesh", None) if mods else None
    if mesh is None:
        raise UnsupportedFeatureError(
            f"the model reports tp_size={size} but its attention's k_proj is not a sharded "
            f"DTensor; the kvcache Engine needs the KV heads split over the ranks")
    group = mesh.get_group()
    q, kv = _measured_heads(model)
    layout = TPLayout(tp=size, rank=dist.get_rank(group), group=group, method="transformers",
                      num_qo_heads=q, num_kv_heads=kv)
    _LAYOUTS[model] = layout
    return layout


def _accelerator_type() -> str:
    acc = getattr(torch, "accelerator", None)
    current = acc.current_accelerator() if acc is not None else None
    return current.type if current is not None else "cpu"


def _transformers_blocker(model, group, tp: int) -> Optional[str]:
    """Why transformers' own plan cannot split ``model`` over ``group`` here (None: it can)."""
    if tp != dist.get_world_size():
        return (f"the tensor-parallel group has {tp} of the world's {dist.get_world_size()} "
                f"ranks, and transformers builds its mesh over the whole world")
    try:
        from transformers.distributed import DistributedConfig  # noqa: F401
        from transformers.distributed.utils import initialize_distributed_mesh  # noqa: F401
    except ImportError:
        return "this transformers version has no transformers.distributed"
    if not hasattr(type(model), "maybe_distribute_model"):
        return f"{type(model).__name__} has no maybe_distribute_model in this transformers version"
    device = next(model.parameters()).device.type
    if device != _accelerator_type():
        return (f"the model is on {device}, and transformers puts its mesh on "
                f"{_accelerator_type()}")
    return None


def _slice(t, dim: int, rank: int, tp: int):
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n).contiguous().clone()


def _split_columns(linear, rank: int, tp: int, name: str) -> None:
    """Keep this rank's slice of the output features (weight rows, bias)."""
    out = linear.weight.shape[0]
    if out % tp:
        raise UnsupportedFeatureError(f"{name}: tp={tp} does not divide its {out} output features")
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(_slice(linear.weight.data, 0, rank, tp),
                                           requires_grad=False)
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(_slice(linear.bias.data, 0, rank, tp),
                                             requires_grad=False)
    linear.out_features = out // tp


def _split_rows(linear, rank: int, tp: int, group, name: str) -> None:
    """Keep this rank's slice of the input features; the partial outputs are summed over the
    group after the module, and the bias (whole) added once after the sum."""
    width = linear.weight.shape[1]
    if width % tp:
        raise UnsupportedFeatureError(f"{name}: tp={tp} does not divide its {width} input features")
    bias = None if linear.bias is None else linear.bias.data.clone()
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(_slice(linear.weight.data, 1, rank, tp),
                                           requires_grad=False)
    linear.bias = None
    linear.in_features = width // tp
    if bias is not None:            # a buffer: model.to(device) moves it with the weights
        linear.register_buffer("tp_bias", bias, persistent=False)

    def reduce(module, args, output):
        dist.all_reduce(output, group=group)
        return output if bias is None else output + module.tp_bias

    linear.register_forward_hook(reduce)


def _shard_by_integration(model, plan: dict, group, rank: int, tp: int) -> None:
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for name, module in modules.items():
            if not rx.fullmatch(name):
                continue
            if style in _WHOLE:
                continue
            if not isinstance(module, torch.nn.Linear):
                raise UnsupportedFeatureError(
                    f"{name} ({type(module).__name__}) has tensor-parallel style {style!r}; the "
                    f"integration splits torch.nn.Linear layers only")
            if style == "colwise":
                _split_columns(module, rank, tp, name)
            elif style == "rowwise":
                _split_rows(module, rank, tp, group, name)
            else:
                raise UnsupportedFeatureError(
                    f"{name} has tensor-parallel style {style!r}, which the integration does not "
                    f"implement (it splits 'colwise' and 'rowwise' layers and keeps {_WHOLE} "
                    f"whole); use method='transformers'")


def _need_distributed() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError(
            "tensor parallelism needs torch.distributed initialised on every rank: launch with "
            "torchrun and call kvcache.distributed.tp.init() (or torch.distributed."
            "init_process_group) before building the Engine")


def shard_model(model, group=None, method: str = "auto") -> TPLayout:
    """Split ``model`` (a transformers causal LM, the same weights on every rank) over the
    ranks of ``group`` (a torch.distributed process group; None: the default group), in place,
    and return its ``TPLayout``. Every rank of the group must call it.

    ``method``: ``"transformers"``, ``"integration"`` or ``"auto"`` (see
    ``kvcache.integrations.tp``). Raises ``InvalidArgumentError`` (torch.distributed not
    initialised, an unknown method, a model already split another way) or
    ``UnsupportedFeatureError`` (the group's size does not divide the head counts, a family whose
    plan does not split the KV heads, a ``method`` that cannot apply here, naming why)."""
    if method not in SHARD_METHODS:
        raise InvalidArgumentError(f"method={method!r} is not one of {SHARD_METHODS}")
    _need_distributed()
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    done = tp_layout(model)
    if done is not None:
        if done.tp != tp or (method != "auto" and method != done.method):
            raise InvalidArgumentError(
                f"the model is already split over {done.tp} ranks by {done.method!r}; it cannot "
                f"be split again over {tp} ranks by {method!r}")
        return done
    family = getattr(model.config, "model_type", "?")
    q, kv = _model_heads(model)
    want = dtp.local_heads(q, kv, tp, f"the {family} model")
    if tp == 1:                                          # one rank: nothing to split
        layout = TPLayout(tp=1, rank=0, group=group, method="none", num_qo_heads=q,
                          num_kv_heads=kv)
        _LAYOUTS[model] = layout
        return layout
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not any(key.endswith("self_attn.k_proj") and style == "colwise" for key, style in plan.items()):
        raise UnsupportedFeatureError(
            f"the {family} model's tensor-parallel plan ({plan or 'none'}) does not split the KV "
            f"heads over the ranks (no column-wise self_attn.k_proj; e.g. a packed qkv_proj whose "
            f"output is gathered), so each rank's cache could not hold num_kv_heads / tp heads")
    blocker = _transformers_blocker(model, group, tp)
    if method == "transformers" and blocker is not None:
        raise UnsupportedFeatureError(f"method='transformers' cannot split the model here: {blocker}")
    chosen = "transformers" if method == "transformers" or (method == "auto" and blocker is None) \
        else "integration"
    if chosen == "transformers":
        from transformers.distributed import DistributedConfig
        from transformers.distributed.utils import initialize_distributed_mesh
        config = DistributedConfig(tp_size=tp)
        _, meshes = initialize_distributed_mesh(config)
        assert meshes is not None                       # tp > 1 always builds a mesh
        # src_data_rank=None inside: each rank keeps its slice of the weights it already holds
        type(model).maybe_distribute_model(model, config, meshes)
        group = meshes.get_mesh("tp").get_group()
    else:
        _shard_by_integration(model, plan, group, rank, tp)
    got = _measured_heads(model)
    if got != want:
        raise UnsupportedFeatureError(
            f"after splitting by {chosen!r}, this rank computes {got[0]} query / {got[1]} KV "
            f"heads, not {want[0]} / {want[1]} (the model's {q} / {kv} over tp={tp})")
    layout = TPLayout(tp=tp, rank=rank, group=group, method=chosen, num_qo_heads=want[0],
                      num_kv_heads=want[1])
    _LAYOUTS[model] = layout
    return layout


class TensorParallelAdapter(TransformersAdapter):
    """The transformers adapter on one tensor-parallel rank: the cache holds this rank's heads,
    and every forward first checks that all ranks planned the same one.

    ``model``: whole (split here with ``shard_model(model, group)``, method ``"auto"``) or
    already split (``shard_model``, or transformers' ``tp_plan="auto"``). ``tp``: the expected
    number of ranks (None: the group's size). ``group``: the process group (None: the default
    group, or the one the model was split over). ``rope``: as ``TransformersAdapter``.

    ``step`` counts the forwards of the current ``generate``; ``plans`` is the ``PlanCheck``.
    Whole-step graphs are captured as on one GPU (on a GPU by default), the collectives inside
    them; the per-step check runs on the host before each step, eager or replayed."""

    def __init__(self, model, rope: str = "model", tp: Optional[int] = None, group=None):
        super().__init__(model, rope)
        if self.states:
            raise UnsupportedFeatureError(
                f"tensor parallelism with the {self.family} model's state layers "
                f"{sorted(self.states)} (recurrent state): their channels are not split "
                f"over ranks yet; run it on one device (tp=None)")
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise InvalidArgumentError(f"tp={tp!r} must be an integer >= 1")
        done = tp_layout(model)
        if done is not None and group is not None and done.group is not group:
            raise InvalidArgumentError(
                f"the model is split over another process group ({done.tp} ranks) than tp_group")
        if done is None:
            _need_distributed()
        size = done.tp if done is not None else dist.get_world_size(group)
        if tp is not None and tp != size:
            raise InvalidArgumentError(
                f"tp={tp}, but the tensor-parallel group has {size} ranks (launch one process "
                f"per rank: torchrun --nproc-per-node={tp}, or pass tp_group)")
        self.layout: TPLayout = done if done is not None else shard_model(model, group)
        self.plans = dtp.PlanCheck(self.layout.group)
        self.step = 0
        self._picked: list = []         # picks the host read since the last step's check

    def cache_config(self, *, dtype, page_size, max_total_tokens, max_batch_size,
                     prefill_chunk_size) -> CacheConfig:
        """The whole model's cache configuration with this rank's query and KV heads."""
        config = super().cache_config(dtype=dtype, page_size=page_size,
                                      max_total_tokens=max_total_tokens,
                                      max_batch_size=max_batch_size,
                                      prefill_chunk_size=prefill_chunk_size)
        return dataclasses.replace(config, num_qo_heads=self.layout.num_qo_heads,
                                   num_kv_heads=self.layout.num_kv_heads)

    def check(self, cache) -> None:
        """Also: every rank built the same engine (cache configuration, backend, layout)."""
        super().check(cache)
        desc = (f"{cache.config!r} backend={cache.backend.name} tp={self.layout.tp} "
                f"method={self.layout.method} vocab={self.vocab_size}")
        digest = int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8).digest(),
                                "little", signed=True)
        self.plans.exchange("building the engine", digest, detail=lambda: f"built {desc}")

    def plan_digest(self, cache, tokens, positions, logit_rows) -> int:
        """This rank's digest of the open forward: the cache's plan (``cache.open_plan``) and the
        step's input tokens, positions and logit rows (see ``kvcache.distributed.tp.plan_digest``)."""
        return dtp.plan_digest(cache.open_plan, tokens, positions, logit_rows)

    def forward(self, cache, tokens, positions, logit_rows):
        self._check_step(cache, tokens, positions, logit_rows)
        return super().forward(cache, tokens, positions, logit_rows)

    def _check_step(self, cache, tokens, positions, logit_rows) -> None:
        """The lockstep check of the open forward (every rank, before the model runs): its plan,
        its input tokens the host has (picks still on the device are covered once read), and
        the picks the host read since the last step."""
        plan = cache.open_plan
        host = np.zeros(0, np.int64) if torch.is_tensor(tokens) else np.asarray(tokens, np.int64)
        tokens = np.concatenate(self._picked + [host])
        self._picked.clear()
        self.plans.exchange(
            f"step {self.step} of generate", self.plan_digest(cache, tokens, positions, logit_rows),
            detail=lambda: f"planned sequences {plan.seq_ids} with {plan.append_lengths.tolist()} "
                           f"new tokens")
        self.step += 1

    def step_graphs(self, cache, compiled: bool = False):
        """As ``TransformersAdapter.step_graphs``: the captured steps hold the model's
        collectives (NCCL all-reduces replay inside the graph; every rank captures and replays
        the same buckets at the same steps, since their plans are the same), and each replay is
        checked like an eager step first."""
        graphs = super().step_graphs(cache, compiled)
        run = graphs.run

        def checked(tokens, positions, logit_rows):
            self._check_step(cache, tokens, positions, logit_rows)
            return run(tokens, positions, logit_rows)
        graphs.run = checked                # type: ignore[method-assign]
        return graphs

    def greedy_async(self, logits, logprobs: bool = True):
        # the picks stay on the device as the next step's input (the host plans one step ahead,
        # as on one GPU); when the host reads them, they go into the next step's digest, so a
        # rank whose picks differ still fails, one step later
        inner = TransformersAdapter.greedy_async(self, logits, logprobs)
        read: list = []

        def result():
            if not read:
                read.append(inner.result())
                self._picked.append(np.asarray(read[0][0], np.int64))
            return read[0]
        return PendingPicks(inner.tokens, result)

    @contextlib.contextmanager
    def session(self, cache):
        """As ``TransformersAdapter.session``; at the end every rank tells the others that it
        finished (or left with an error), so a rank still planning a forward fails at once
        instead of waiting in a collective."""
        self.step = 0
        self.plans.failed = False
        self._picked.clear()
        with super().session(cache):
            try:
                yield
            except BaseException:
                if not self.plans.failed:
                    try:
                        self.plans.exchange(f"the end of generate (step {self.step})", dtp.ABORT)
                    except dtp.PlanMismatchError:
                        pass                            # the others now fail too; keep our error
                raise
            if not self.plans.failed:
                self.plans.exchange(f"the end of generate (step {self.step})", dtp.END)

    def device_memory(self, device):
        """The least free memory of any rank (and the largest total), so that every rank sizes
        the same cache: their forwards must hold the same pages."""
        info = super().device_memory(device)
        if info is None:
            return None
        both = torch.tensor([info[0], -info[1]], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self.layout.group)
        return int(both[0]), -int(both[1])

    def peak_memory(self, device, run) -> int:
        """The largest peak of any rank."""
        peak = torch.tensor([super().peak_memory(device, run)], dtype=torch.int64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.layout.group)
        return int(peak[0])

