"""The serving loop, neutral to model and array libraries: ``Scheduler`` (which sequences each
forward runs), ``EngineCore`` (``add_request`` / ``step`` / ``abort`` over a scheduler and a model
runner), ``RequestOutput`` and ``EngineStats``. The model runner lives with the integrations
(``kvcache.integrations.runner``)."""

from .core import EngineCore
from .request import FINISH_REASONS, Request, RequestOutput
from .scheduler import Scheduler, StepPlan
from .stats import EngineStats

__all__ = ["FINISH_REASONS", "EngineCore", "EngineStats", "Request", "RequestOutput", "Scheduler",
           "StepPlan"]
