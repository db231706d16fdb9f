"""Cut a draft model for speculative decoding from a Llama-family model's first decoder layers.

The drafter keeps the model's vocabulary, embeddings, final norm and LM head and its first
`--layers` decoder layers (an early-exit drafter, not fine-tuned): a smaller model that shares the
target's vocabulary, which `{"method": "draft_model", "model": OUT, ...}` needs. It is written as a
Hugging Face folder (config.json, safetensors, tokenizer).

    python benchmarks/make_layer_drafter.py --layers 6 /tmp/smollm2-6l
    atomrt bench latency --model SmolLM2-135M-Instruct --device cpu --modes eager \\
        --speculative-config '{"method": "draft_model", "model": "/tmp/smollm2-6l", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the folder to write")
    p.add_argument(
        "--model",
        default="SmolLM2-135M-Instruct",
        help="a model folder, .gguf or the embedded model",
    )
    p.add_argument("--layers", type=int, default=6, help="decoder layers the drafter keeps")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atomrt.workers.loading.loader import resolve_model

    resolved = resolve_model(args.model)
    if resolved.kind == "gguf":
        where, kw = resolved.path.parent, {"gguf_file": resolved.path.name}
    elif resolved.kind == "safetensors":
        where, kw = resolved.path, {}
    else:
        p.error(f"{args.model}: a preset has no weights to cut")
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
    total = model.config.num_hidden_layers
    if not 0 < args.layers < total:
        p.error(f"--layers must be in [1, {total - 1}] for a model of {total} layers")
    model.model.layers = model.model.layers[: args.layers]
    model.config.num_hidden_layers = args.layers
    # A GGUF load is dequantized to float32 weights: save those, not as a quantized model.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(args.out, safe_serialization=True)
    AutoTokenizer.from_pretrained(where, **kw).save_pretrained(args.out)
    print(
        f"wrote {args.out}: {args.layers} of {total} layers, {model.num_parameters() / 1e6:.1f}M parameters"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
