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


def alternate(rounds, commands):
    """Runs each (command, env) of `commands` in turn, round after round;
    returns name -> dtype -> list of per-round rows of their JSON lines."""
    samples = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        for command, env in commands:
            for row in run_json_lines(command, env=env):
                samples[row["name"]][row["dtype"]].append(row)
    return samples


def torch_command(args, mode, extra=()):
    """torch_bench.py with the run's time and shape filter."""
    return ["/usr/bin/python3", os.path.join(HERE, "torch_bench.py"), "--mode", mode,
            "--min_seconds", str(args.min_seconds), "--shapes", args.shapes] + list(extra)


def collect(args):
    """name -> dtype -> list of per-round rows."""
    # Optional: the wider models, and fewer repetitions for slow shapes.
    extra = (["--wide"] if getattr(args, "wide", False) else []) + (
        [f"--min_reps={args.min_reps}"] if getattr(args, "min_reps", None) else [])
    commands = [([args.mha_bench, "--json", f"--shapes={args.shapes}",
                  f"--min_seconds={args.min_seconds}"] + extra, None)]
    for mode in args.torch_modes.split(","):
        commands.append((torch_command(args, mode, extra), torch_env(mode)))
    return alternate(args.rounds, commands)


def median_of(rows, key):
    return statistics.median(r[key] for r in rows)


def share_of_matmul(rows):
    return statistics.median(r["gflops"] / r["matmul_gflops"] for r in rows)


def table(samples, torch_modes):
    head = ["shape", "ours f32 ms", "GFLOP/s", "% of f32 matmul", "ours bf16 ms",
            "bf16 vs f32", "% of bf16 matmul"]
    for mode in torch_modes:
        head += [f"torch {mode} ms", f"ours f32 vs torch {mode}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_dtype in samples.items():
        f32, bf16 = by_dtype.get("f32"), by_dtype.get("bf16")
        if not f32:
            continue
        f32_ms = median_of(f32, "ms")
        cells = [name, f"{f32_ms:.3f}", f"{median_of(f32, 'gflops'):.0f}",
                 f"{share_of_matmul(f32):.0%}"]
        if bf16:
            bf16_ms = median_of(bf16, "ms")
            cells += [f"{bf16_ms:.3f}", f"{f32_ms / bf16_ms:.2f}x faster",
                      f"{share_of_matmul(bf16):.0%}"]
        else:
            cells += ["-", "-", "-"]
        for mode in torch_modes:
            rows = by_dtype.get("torch_" + mode)
            if rows:
                t = median_of(rows, "ms")
                cells += [f"{t:.3f}", f"{t / f32_ms:.2f}x faster"]
            else:
                cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_parser(description):
    """The flags every alternated run takes: mha_bench, rounds, time per
    measurement, a shape filter."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--mha_bench", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min_seconds", type=float, default=0.3)
    parser.add_argument("--shapes", default="")
    return parser


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--torch_modes", default="best,default")
    args = parser.parse_args()
    print(table(collect(args), args.torch_modes.split(",")))


if __name__ == "__main__":
    main()
