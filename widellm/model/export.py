"""Write a GGUF checkpoint out as an ordinary Hugging Face folder (config.json, safetensors,
tokenizer, generation config), so other engines can load the very same weights::

    python -m widellm.model.export default /tmp/smollm2-hf      # the default model
    python -m widellm.model.export path/to/model.gguf OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

from widellm.engine.tokenizer import tokenizer_from_gguf
from widellm.model.default_model import default_model_path
from widellm.model.gguf_loader import load_gguf

DEFAULT_ALIAS = "default"


def export_gguf(path: str, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> str:
    ckpt = load_gguf(path)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: t.to(dtype).contiguous() for name, t in ckpt.weights()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = ckpt.config
    config.dtype = dtype
    config.save_pretrained(out_dir)
    eos = list(ckpt.generation_eos_token_ids)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos[0] if len(eos) == 1 else eos,
                   "bos_token_id": config.bos_token_id}, f, indent=2)
    tokenizer = tokenizer_from_gguf(path)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    src = default_model_path() if argv[0] == DEFAULT_ALIAS else argv[0]
    print(export_gguf(src, argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
