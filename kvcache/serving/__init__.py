"""The serving loop, neutral to model and array libraries: ``Scheduler`` (which sequences each
forward runs: ``schedule()`` a ``StepPlan``, ``update(plan, output)`` books the runner's
``StepOutput``) and ``AsyncScheduler`` (the host one step ahead of the device), ``EngineCore``
(``add_request`` / ``step`` / ``abort`` over a scheduler and a model runner),
``SamplingParams``, ``EngineConfig`` (an engine's options), ``RequestOutput`` and
``EngineStats``; the ``typing.Protocol`` classes of what the loop drives are in
``kvcache.serving.protocols``. The model runner lives with the integrations
(``kvcache.integrations.runner``)."""

from .async_scheduler import AsyncScheduler
from .config import EngineConfig
from .core import EngineCore
from .plan import StepOutput, StepPlan
from .request import FINISH_REASONS, Request, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .stats import EngineStats

__all__ = ["FINISH_REASONS", "AsyncScheduler", "EngineConfig", "EngineCore", "EngineStats",
           "Request", "RequestOutput", "SamplingParams", "Scheduler", "StepOutput", "StepPlan"]
