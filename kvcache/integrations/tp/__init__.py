"""Tensor parallelism for transformers models on the ``Engine`` (extra ``kvcache[transformers]``).

One process per rank (``torchrun --nproc-per-node=TP``, or ``kvcache.distributed.tp.spawn``),
torch.distributed initialised (``kvcache.distributed.tp.init()``). Every rank holds the same
model; ``Engine(model, tp=TP)`` splits it the Megatron way: the attention's q/k/v projections
column-wise (each rank computes ``num_qo_heads / TP`` query heads and ``num_kv_heads / TP`` KV
heads), ``o_proj`` row-wise, the MLP's gate/up column-wise and ``down_proj`` row-wise, with an
all-reduce after ``o_proj`` and ``down_proj``. Each rank's cache holds its own KV heads only, and
every rank runs the same scheduler: planning is identical on every rank, and checked to be
(``kvcache.distributed.tp.PlanCheck``: the ranks' plan digests are compared every step).
The logits are whole on every rank (the vocabulary head is replicated or gathered), so every
rank samples the same tokens from the same seed; the next step's digest covers those tokens.

Who splits the model (``shard_model``, ``method``):

* ``"transformers"``: transformers' own plan (the family's ``tp_plan``, as
  ``from_pretrained(..., tp_plan="auto")`` applies it) on the model in memory: each rank keeps its
  slice of the weights it holds (a model built from the same seed, or loaded from one
  checkpoint, holds the same weights on every rank). It needs the tensor-parallel group to be
  the whole world (transformers builds its mesh over every rank) and the model on the
  accelerator transformers picks (the CPU where there is none).
* ``"integration"``: the same layout by slicing each projection's weights in place and adding
  the two all-reduces as forward hooks; works on any process group (e.g. a TP group inside a
  larger world) and with any transformers version. Vocabulary embedding and head stay whole.
* ``"auto"`` (default): ``"transformers"`` where it applies, else ``"integration"``.

A model that ``from_pretrained(..., tp_plan="auto")`` already split (``model.tp_size > 1``) is
used as it is. Families whose plan does not split the KV heads (Phi-3: its packed ``qkv_proj`` is
gathered) and ``tp`` not dividing the head counts raise ``UnsupportedFeatureError``.

``python -m kvcache.integrations.tp`` (launched by ``torchrun --nproc-per-node=TP``) is its
command: tensor-parallel greedy generation that rank 0 checks against one process (``--help``).
"""

from ..transformers.tp import (SHARD_METHODS, TPLayout, TensorParallelAdapter, shard_model,
                               tp_layout)

__all__ = ["SHARD_METHODS", "TPLayout", "TensorParallelAdapter", "shard_model", "tp_layout"]
