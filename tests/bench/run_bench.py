"""Runs mha_bench and PyTorch on the same shapes in one run, alternating the
programs for several rounds (these machines are shared and noisy), and
prints a Markdown table of medians and ratios.

    python3 tests/bench/run_bench.py --mha_bench build/mha_bench [--rounds 3]
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_json_lines(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def torch_env(mode):
    env = dict(os.environ)
    if mode == "best":
        env["OPENBLAS_CORETYPE"] = "SkylakeX"
    return env


def collect(args):
    """name -> dtype -> list of per-round medians (ms)."""
    samples = collections.defaultdict(lambda: collections.defaultdict(list))
    common = ["--min_seconds", str(args.min_seconds), "--shapes", args.shapes]
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        runs = [run_json_lines([args.mha_bench, "--json", f"--min_seconds={args.min_seconds}",
                                f"--shapes={args.shapes}"])]
        for mode in args.torch_modes.split(","):
            runs.append(run_json_lines(
                ["/usr/bin/python3", os.path.join(HERE, "torch_bench.py"), "--mode", mode]
                + common, env=torch_env(mode)))
        for run in runs:
            for row in run:
                samples[row["name"]][row["dtype"]].append(row["ms"])
    return samples


def gflop(name):
    """GFLOP of a shape from its name, the count both programs use."""
    if name.startswith("matmul"):
        return 2 * 1024 ** 3 * 1e-9
    parts = dict((p[0], int(p[1:])) for p in name.split("_")[1:])
    b, l, e = parts["b"], parts["l"], parts["e"]
    s = parts.get("s", l)
    return (2 * b * l * e * e * 2 + 2 * b * s * e * 2 * e + 4.0 * b * l * s * e) * 1e-9


def table(samples, torch_modes):
    med = {n: {d: statistics.median(v) for d, v in ds.items()} for n, ds in samples.items()}
    ceiling = {d: gflop("matmul_n1024") / (med["matmul_n1024"][d] * 1e-3) for d in ("f32", "bf16")
               if d in med.get("matmul_n1024", {})}
    lines = [f"oneDNN matmul n=1024 (same run): f32 {ceiling.get('f32', 0):.0f} GFLOP/s, "
             f"bf16 {ceiling.get('bf16', 0):.0f} GFLOP/s", ""]
    head = ["shape", "ours f32 ms", "GFLOP/s", "% of matmul", "ours bf16 ms", "bf16 speed-up"]
    for mode in torch_modes:
        head += [f"torch {mode} ms", f"torch {mode} / ours f32"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in med.items():
        if name.startswith("matmul") or "f32" not in row:
            continue
        rate = gflop(name) / (row["f32"] * 1e-3)
        cells = [name, f"{row['f32']:.3f}", f"{rate:.0f}",
                 f"{100 * rate / ceiling.get('f32', rate):.0f} %",
                 f"{row.get('bf16', float('nan')):.3f}",
                 f"{row['f32'] / row.get('bf16', float('nan')):.2f}x"]
        for mode in torch_modes:
            t = row.get("torch_" + mode, float("nan"))
            cells += [f"{t:.3f}", f"{t / row['f32']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mha_bench", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min_seconds", type=float, default=1.0)
    parser.add_argument("--shapes", default="")
    parser.add_argument("--torch_modes", default="best,default")
    args = parser.parse_args()
    print(table(collect(args), args.torch_modes.split(",")))


if __name__ == "__main__":
    main()
