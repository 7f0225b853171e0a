"""One gpt-oss MoE layer read from a checkpoint directory: its time per call and its error
against the float32 reference (`mc.reference`).

    python examples/gpt_oss_layer.py /models/gpt-oss-120b --layer 3 --tokens 64
    python examples/gpt_oss_layer.py --synthesize /tmp/gpt-oss-layer --tokens 64

--synthesize DIR first writes a checkpoint of one layer in the real layout: transformers' gpt-oss
names (``model.layers.L.mlp.router.*``, ``experts.gate_up_proj_blocks`` [E, 2I, H/32, 16] with
interleaved gate/up rows, ``_scales``, ``_bias``, ``down_proj_*``) in two shards with
model.safetensors.index.json and config.json, random MXFP4 weights of gpt-oss-120b's shape
(128 experts, H = I = 2880) unless --experts says fewer. Then it reads DIR like a real checkpoint.
"""
import argparse
import json
import math
import time
from pathlib import Path

import torch

import moe_cutlass as mc


def synthesize(directory, layer, num_experts, hidden, inter, top_k, device):
    from safetensors.torch import save_file

    gen = torch.Generator(device).manual_seed(0)

    def mxfp4(rows, k):  # random weights, a different power-of-two scale per 32-block
        w = torch.randn(num_experts, rows, k // 32, 32, generator=gen, device=device)
        w = w * 2.0 ** torch.randint(-3, 3, (num_experts, rows, k // 32, 1), generator=gen, device=device)
        blocks, scales = mc.quantize_mxfp4(w.flatten(-2) / math.sqrt(k))
        return blocks.view(num_experts, rows, k // 32, 16).cpu(), scales.cpu()

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).bfloat16().cpu()

    p = f"model.layers.{layer}.mlp."
    w13_blocks, w13_scales = mxfp4(2 * inter, hidden)
    w2_blocks, w2_scales = mxfp4(hidden, inter)
    shards = {
        "model-00001-of-00002.safetensors": {
            p + "router.weight": randn(num_experts, hidden, scale=1 / math.sqrt(hidden)),
            p + "router.bias": randn(num_experts, scale=0.1),
            p + "experts.gate_up_proj_blocks": w13_blocks, p + "experts.gate_up_proj_scales": w13_scales,
            p + "experts.gate_up_proj_bias": randn(num_experts, 2 * inter, scale=0.1)},
        "model-00002-of-00002.safetensors": {
            p + "experts.down_proj_blocks": w2_blocks, p + "experts.down_proj_scales": w2_scales,
            p + "experts.down_proj_bias": randn(num_experts, hidden, scale=0.1)},
    }
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, directory / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "num_local_experts": num_experts, "num_experts_per_tok": top_k,
        "hidden_size": hidden, "intermediate_size": inter, "swiglu_limit": 7.0}))


def time_call(fn, device, reps):
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, help="checkpoint directory (safetensors)")
    parser.add_argument("--synthesize", type=Path, metavar="DIR", help="write a one-layer checkpoint to DIR first")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--experts", type=int, default=128, help="experts of the synthesized layer")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if (args.path is None) == (args.synthesize is None):
        parser.error("give a checkpoint directory or --synthesize DIR")
    device = torch.device(args.device)
    path = args.path or args.synthesize
    if args.synthesize:
        synthesize(path, args.layer, args.experts, 2880, 2880, 4, device)

    start = time.perf_counter()
    layer = mc.MoELayer.from_checkpoint(path, args.layer, device=device)
    load_s = time.perf_counter() - start
    x = torch.randn(args.tokens, layer.hidden_size, device=device).bfloat16()
    weights, ids = layer.route(x)
    out = layer(x, topk_weights=weights, topk_ids=ids)
    ref = mc.reference.fused_moe_float(x, layer.experts, weights, ids, activation=layer.activation,
                                       swiglu_limit=layer.swiglu_limit, swiglu_alpha=layer.swiglu_alpha)
    relerr = float((out.float() - ref).norm() / ref.norm())
    us = time_call(lambda: layer(x, topk_weights=weights, topk_ids=ids), device, args.reps)
    print(f"{path} layer {args.layer}: {layer.num_experts} experts, H={layer.hidden_size}, "
          f"I={layer.intermediate_size}, top_k={layer.top_k}; loaded in {load_s:.1f} s")
    print(f"M={args.tokens} on {device}: {us:.1f} us per call (eager, routing excluded), "
          f"relative error vs mc.reference {relerr:.2e}")


if __name__ == "__main__":
    main()
