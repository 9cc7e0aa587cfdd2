#!/usr/bin/env bash
# The "try it" command: installs what is missing, builds, and runs the built-in
# demo model (models/demo: nn.MultiheadAttention(256, 4)) on a random batch
# with mha_run, printing what came out. (The gRPC server arrives with issue 3;
# this script will start it instead.)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
bash "$here/install_deps.sh"
bash "$here/build.sh"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 - "$work" "$root/tests/parity" <<'PY'
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from mha_model_io import write_safetensors
rng = np.random.default_rng(0)
query = (rng.standard_normal((2, 16, 256)) * 0.5).astype(np.float32)
write_safetensors(f"{sys.argv[1]}/in.safetensors", {"query": (query, "F32")})
PY
"$root/build/mha_run" --model "$root/models/demo" --inputs "$work/in.safetensors" \
  --outputs "$work/out.safetensors" --need_weights
/usr/bin/python3 - "$work" "$root/tests/parity" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
from mha_model_io import read_safetensors
arrays, _ = read_safetensors(f"{sys.argv[1]}/out.safetensors")
out, w = arrays["output"], arrays["attn_weights"]
print(f"demo model: self-attention on query [2, 16, 256]")
print(f"output {list(out.shape)}  first values", " ".join(f"{v:+.4f}" for v in out.ravel()[:4]))
print(f"attn_weights {list(w.shape)}  rows sum to {w.sum(-1).mean():.4f}")
PY
