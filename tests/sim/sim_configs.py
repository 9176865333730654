"""HF config dicts the simulator tests share: the published models of widellm/sim/known_models.py."""

from widellm.sim.known_models import DEEPSEEK_V3, DEEPSEEK_V3_SMALL, LLAMA3_8B, QWEN3_30B_A3B

__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V3_SMALL", "LLAMA3_8B", "QWEN3_30B_A3B"]
