#!/usr/bin/python3
"""Writes the built-in demo model: nn.MultiheadAttention(256, 4) initialised
with torch.manual_seed(0), stored as its PyTorch state_dict (packed
in_proj_weight layout).

  python3 tests/parity/make_demo_model.py [DIR]   (default: models/demo)
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mha_model_io import format_pbtxt, write_safetensors  # noqa: E402

EMBED_DIM, NUM_HEADS = 256, 4


def demo_module():
    torch.manual_seed(0)
    return torch.nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, batch_first=True)


def write_demo_model(model_dir):
    os.makedirs(model_dir, exist_ok=True)
    state = demo_module().state_dict()
    tensors = {name: (t.detach().numpy(), "F32") for name, t in state.items()}
    write_safetensors(os.path.join(model_dir, "weights.safetensors"), tensors,
                      metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
        f.write(format_pbtxt({"embed_dim": EMBED_DIM, "num_heads": NUM_HEADS}))
    print(f"wrote {model_dir}: " + ", ".join(
        f"{n} {list(t.shape)}" for n, t in state.items()))


if __name__ == "__main__":
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "..", "..", "models", "demo")
    write_demo_model(os.path.normpath(sys.argv[1] if len(sys.argv) > 1
                                      else default))
