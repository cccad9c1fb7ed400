"""The transformers backend: a continuous-batching decode loop over a HuggingFace causal LM (the embedded default)."""

from .engine import DecodeEngine, Job
from ..sampling import sample_row, sample_rows

TransformersEngine = DecodeEngine

__all__ = ["DecodeEngine", "Job", "TransformersEngine", "sample_row", "sample_rows"]
