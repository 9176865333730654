"""The GGUF -> Hugging Face export carries the same model: widellm gives the same greedy chat
answer from both, and transformers loads the exported folder."""

from __future__ import annotations

from widellm import LLM, SamplingParams
from widellm.model.default_model import default_model_path
from widellm.model.export import export_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_export_matches_gguf(tmp_path):
    out = export_gguf(default_model_path(), str(tmp_path / "hf"))
    params = SamplingParams(temperature=0, max_tokens=16)
    kwargs = dict(dtype="float32", num_kv_blocks=64, max_model_len=1024)
    from_gguf = LLM(**kwargs).chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    from_hf = LLM(out, **kwargs).chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    # The export is bf16 while the GGUF dequantizes to fp32, so logits differ slightly:
    # compare the greedy answers, not the numbers.
    assert "Paris" in from_hf.text and from_hf.text == from_gguf.text
