"""Decode of a DeepSeek-V3-shaped slice of one EP32 rank on one GPU (issue 25's goal: at 256
sequences, at least 60% of the HBM roofline), run by benchmarks/gpu/check.sh.

The slice: DeepSeek-V3's own layer sizes (hidden 7,168, MLA with 128 heads and a 512 + 64
latent, dense MLP 18,432, routed experts 2,048 wide, its 129,280-token vocabulary), a few
layers (one dense, then MoE), and per MoE layer the 8 routed experts one rank of EP32 holds
(256 / 32) plus the shared one. Every token picks all 8 (top-8 of 8), so each local expert
sees the batch's rows, as on an EP32 rank where 256 sequences x 8 picks spread over 256
experts give each expert ~8 rows per rank, times 32 ranks' tokens: the rank's experts compute
what they would, without the all-to-all (one GPU has no peers; the simulator prices that).

Weights are random (a checkpoint written once per run from the parameter shapes, without
building the model on the host), in DeepSeek's FP8 block format with ``--fp8`` (default) or
bf16. Output tok/s = sequences x new tokens / decode time, where decode time is the
generate() time of ``--new`` tokens minus that of one token (the prompts' prefill). The
roofline: bytes a decode step must read (every weight but the embedding, and each sequence's
latent KV cache per layer) per step time, over the measured device copy bandwidth.

``--scale-down`` shrinks every size (for checking the script on a CPU).

Usage: python benchmarks/gpu/ep32_slice.py [--seqs 64,256] [--fp8|--bf16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from device_side import engine_side

GIB = 1 << 30
SHARD_BYTES = 2 * GIB
# DeepSeek-V3's config.json, layer sizes kept; layers and experts are the slice's.
SLICE_CONFIG = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=8, num_experts_per_tok=8, n_shared_experts=1,
    n_group=1, topk_group=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=4096, num_mtp_layers=0, bos_token_id=0, eos_token_id=1,
    pad_token_id=2,
)
SCALED_DOWN = dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                   moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                   q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32,
                   qk_nope_head_dim=32, v_head_dim=32)
WEIGHT_STD = 0.02


def checkpoint_shapes(state_dict: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes as DeepSeek's checkpoints store them: transformers holds a
    layer's routed experts fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj
    [E, H, I]``), the checkpoints one ``experts.{e}.{gate,up,down}_proj.weight`` each."""
    shapes = {}
    for name, t in state_dict.items():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("experts.gate_up_proj"):
            experts, two_inter, hidden = t.shape
            for e in range(experts):
                for proj in ("gate_proj", "up_proj"):
                    shapes[f"{prefix}.{e}.{proj}.weight"] = (two_inter // 2, hidden)
        elif name.endswith("experts.down_proj"):
            experts, hidden, inter = t.shape
            for e in range(experts):
                shapes[f"{prefix}.{e}.down_proj.weight"] = (hidden, inter)
        else:
            shapes[name] = tuple(t.shape)
    return shapes


def write_random_checkpoint(config, folder: str, fp8: bool) -> None:
    """config.json, tokenizer and random safetensors shards (FP8 blocks where DeepSeek's
    checkpoints have them), from the parameter shapes of a model built on the meta device."""
    import transformers
    from safetensors.torch import save_file

    from widellm.model.fp8 import deepseek_fp8_quantization_config, quantize_weight_block_fp8
    from widellm.model.fp8_weights import QUANTIZATION_CONFIG_KEY, scale_inv_name
    from widellm.model.preset_tokenizer import build_tokenizer
    from widellm.model.presets_fp8 import WEIGHT_BLOCK_SIZE, is_fp8_linear_weight

    with torch.device("meta"):
        shapes = checkpoint_shapes(transformers.DeepseekV3ForCausalLM(config).state_dict())
    weight_map, shard, shard_bytes, index = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, index
        name = f"model-{index:05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes, index = {}, 0, index + 1

    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            tensors = {name: torch.ones(shape, dtype=torch.bfloat16)}
        elif name.endswith("e_score_correction_bias"):
            tensors = {name: torch.zeros(shape)}
        else:
            w = torch.randn(shape, generator=g) * WEIGHT_STD
            if fp8 and is_fp8_linear_weight(name):
                q, scale = quantize_weight_block_fp8(w, WEIGHT_BLOCK_SIZE)
                tensors = {name: q, scale_inv_name(name): scale}
            else:
                tensors = {name: w.to(torch.float32 if "mlp.gate.weight" in name
                                      else torch.bfloat16)}
        for k, t in tensors.items():
            shard[k] = t.contiguous()
            shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config.save_pretrained(folder)
    if fp8:
        with open(os.path.join(folder, "config.json")) as f:
            data = json.load(f)
        data[QUANTIZATION_CONFIG_KEY] = deepseek_fp8_quantization_config(WEIGHT_BLOCK_SIZE)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(data, f, indent=1)
    build_tokenizer(config.vocab_size, config.max_position_embeddings).save_pretrained(folder)


def step_bytes(model, seqs: int, context: int, kv_bytes_per_token_layer: int,
               num_layers: int) -> int:
    """Bytes one decode step reads: every parameter but the embedding table (a gather of a
    few rows), plus each sequence's latent KV cache in every layer."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n)
    return weights + seqs * context * kv_bytes_per_token_layer * num_layers


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bytes/s (read + write) of a 1 GiB buffer (CPU: 64 MiB)."""
    n = GIB if device == "cuda" else 64 << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start, iters = time.perf_counter(), 10
    for _ in range(iters):
        dst.copy_(src)
    sync()
    return 2 * n * iters / (time.perf_counter() - start)


def main() -> int:
    from transformers import DeepseekV3Config

    from widellm import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="64,256")
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens per sequence")
    ap.add_argument("--new", type=int, default=64, help="decode tokens per sequence")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights instead of FP8")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--scale-down", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    engine_side(args.device, "")
    seqs = [int(s) for s in args.seqs.split(",")]
    config = DeepseekV3Config(**{**SLICE_CONFIG, **(SCALED_DOWN if args.scale_down else {})})
    config.architectures = ["DeepseekV3ForCausalLM"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ep32-slice-") as folder:
        start = time.perf_counter()
        write_random_checkpoint(config, folder, fp8=not args.bf16)
        print(f"checkpoint written in {time.perf_counter() - start:.1f} s", flush=True)
        bandwidth = copy_bandwidth(args.device)
        context = args.prompt + args.new // 2
        with LLM(folder, dtype="bfloat16", device=args.device, max_num_seqs=max(seqs),
                 max_model_len=args.prompt + args.new + 8,
                 max_num_batched_tokens=max(8192, args.prompt)) as llm:
            model = llm.llm_engine.engine_core.model_runner.model
            kv_token_layer = (config.kv_lora_rank + config.qk_rope_head_dim) * 2
            for n in seqs:
                prompts = [[3 + (7 * i + j) % 500 for j in range(args.prompt)] for i in range(n)]

                def timed(tokens: int) -> float:
                    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
                    t0 = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    return time.perf_counter() - t0

                timed(2)  # warm
                decode_s = timed(args.new + 1) - timed(1)
                step_s = decode_s / args.new
                read = step_bytes(model, n, context, kv_token_layer, config.num_hidden_layers)
                rows.append({"seqs": n, "output_tok_s": round(n * args.new / decode_s, 1),
                             "step_ms": round(step_s * 1e3, 3),
                             "bytes_per_step_gib": round(read / GIB, 3),
                             "roofline_share": round(read / step_s / bandwidth, 3),
                             "copy_bw_gib_s": round(bandwidth / GIB, 1)})
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fp8": not args.bf16, "device": args.device, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
