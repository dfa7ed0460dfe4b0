"""The reference engine: a small real torch model (``model``), its paged pool (``pool``),
configuration (``config``) and the engine loop (``engine``). See each module."""

from engine_plugin.reference.config import MODEL_PRESETS, EngineConfig, ModelConfig, model_preset
from engine_plugin.reference.engine import Engine, Request, SamplingParams, SendState
from engine_plugin.reference.model import REPLAY_SPANS, ReferenceModel, WindowState

__all__ = ["MODEL_PRESETS", "REPLAY_SPANS", "Engine", "EngineConfig", "ModelConfig", "ReferenceModel",
           "Request", "SamplingParams", "SendState", "WindowState", "model_preset"]
