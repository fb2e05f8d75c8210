"""The target side of Dovetail: a Llama-family decoder on the CPU that prefills, decodes and
verifies draft trees."""

from .engine import ContextOverflowError, StepOutput, TargetEngine, VerifyOutcome, greedy_decode
from .llama import LlamaDecoder, LlamaSpec, ModelConfigError
from .loading import ModelLoadError, load_target_model, resolve_model_dir
from .precision import TARGET_DTYPES, apply_precision

__all__ = [
    "ContextOverflowError", "StepOutput", "TargetEngine", "VerifyOutcome", "greedy_decode",
    "LlamaDecoder", "LlamaSpec", "ModelConfigError", "ModelLoadError", "load_target_model",
    "resolve_model_dir", "TARGET_DTYPES", "apply_precision",
]
