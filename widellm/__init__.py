"""widellm: an inference and serving engine for sparse Mixture-of-Experts LLMs."""

from widellm.engine.llm import LLM
from widellm.outputs import CompletionOutput, RequestOutput
from widellm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
