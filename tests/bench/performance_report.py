#!/usr/bin/python3
"""Regenerates docs/performance_report.md and its charts from one run on this machine:

    /usr/bin/python3 tests/bench/performance_report.py      # after deploy/debian/build.sh

1. The standard shapes: our engine (fp32, bf16) and PyTorch's
   nn.MultiheadAttention in two configurations (Debian's defaults, and tuned:
   2 threads from a worker thread, OpenBLAS told the CPU type), alternated
   round after round (run_bench.py), with the plain oneDNN matmul rate
   measured beside each shape.
2. GFLOP/s against sequence length (self-attention, B=1, E=512, h=8) for
   ours, PyTorch and the matmul rate, up to L = 16384 for ours, with the
   scratch memory the engine held.
3. The server: throughput and p99 latency against concurrency, batching on
   and off (mha_client load --sweep against a local mha_server).

Nothing else should run meanwhile: the numbers are medians, and ratios taken
in the same run are what to compare across machines.
"""

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import run_bench  # noqa: E402
import server_cpu  # noqa: E402
from mha_local_server import LocalServer  # noqa: E402
from svg_chart import line_chart  # noqa: E402

SEQ_LENGTHS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TORCH_MAX_LEN = 4096  # PyTorch materialises h x L x L scores: 8.6 GB at 16384
CONCURRENCY = [1, 4, 16, 64]


def machine():
    cpu = "unknown CPU"
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            cpu = line.split(":", 1)[1].strip()
    versions = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Version}\\n", "libdnnl2", "python3-torch"],
        capture_output=True, text=True).stdout.strip().replace("\n", ", ")
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    bf16 = ("bf16 instructions: AMX" if "amx_bf16" in flags else
            "bf16 instructions: AVX512-BF16" if "avx512_bf16" in flags else
            "no bf16 instructions (bf16 runs emulated)" if "avx512f" in flags else
            "no AVX-512 (oneDNN has no bf16 kernels: fp32 only)")
    return (f"{cpu}, {os.cpu_count()} cores visible, {bf16}, {platform.system()} "
            f"{platform.release()}; {versions}")


# ---------------------------------------------------------------- standard shapes

def standard_table(samples):
    head = ["shape", "ours fp32 ms", "GFLOP/s", "% of fp32 matmul", "ours bf16 ms",
            "bf16 speed-up", "torch default ms", "torch tuned ms", "ours fp32 / torch best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_dtype in samples.items():
        f32, bf16 = by_dtype.get("f32"), by_dtype.get("bf16")
        f32_ms = run_bench.median_of(f32, "ms")
        cells = [f"`{name}`", f"{f32_ms:.3f}", f"{run_bench.median_of(f32, 'gflops'):.0f}",
                 f"{run_bench.share_of_matmul(f32):.0%}"]
        if bf16:
            bf16_ms = run_bench.median_of(bf16, "ms")
            cells += [f"{bf16_ms:.3f}", f"{f32_ms / bf16_ms:.2f}x"]
        else:
            cells += ["-", "-"]
        torch_ms = {m: run_bench.median_of(by_dtype[f"torch_{m}"], "ms")
                    for m in ("default", "best") if by_dtype.get(f"torch_{m}")}
        cells += [f"{torch_ms['default']:.3f}" if "default" in torch_ms else "-",
                  f"{torch_ms['best']:.3f}" if "best" in torch_ms else "-"]
        cells.append(f"{f32_ms / min(torch_ms.values()):.2f}" if torch_ms else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- sequence length

def sequence_sweep(args):
    """{series name: {L: GFLOP/s}}, and the rows of ours for the table."""
    lengths = ",".join(map(str, SEQ_LENGTHS))
    ours = run_bench.run_json_lines([
        args.mha_bench, "--json", f"--seq_lengths={lengths}", "--rounds=1", "--min_reps=3",
        "--min_seconds=0.2"])
    series = {"ours fp32": {}, "ours bf16": {}, "oneDNN matmul fp32": {},
              "oneDNN matmul bf16": {}, "torch tuned": {}, "torch default": {}}
    for row in ours:
        n = int(row["name"].split("_")[1][1:])
        dtype = "fp32" if row["dtype"] == "f32" else "bf16"
        series[f"ours {dtype}"][n] = row["gflops"]
        series[f"oneDNN matmul {dtype}"][n] = row["matmul_gflops"]
    torch_lengths = ",".join(str(n) for n in SEQ_LENGTHS if n <= TORCH_MAX_LEN)
    for mode, label in (("best", "torch tuned"), ("default", "torch default")):
        for row in run_bench.run_json_lines(
                ["/usr/bin/python3", os.path.join(HERE, "torch_bench.py"), "--mode", mode,
                 "--seq_lengths", torch_lengths, "--min_reps", "3", "--min_seconds", "0.2"],
                env=run_bench.torch_env(mode)):
            series[label][int(row["name"].split("_")[1][1:])] = row["gflops"]
    return series, ours


def sequence_table(ours):
    lines = ["| L | fp32 ms | fp32 GFLOP/s | % of matmul | time / time at L/2 | scratch MiB | "
             "bf16 ms | bf16 GFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    by = {(int(r["name"].split("_")[1][1:]), r["dtype"]): r for r in ours}
    for n in SEQ_LENGTHS:
        f32, bf16 = by.get((n, "f32")), by.get((n, "bf16"))
        if not f32:
            continue
        half = by.get((n // 2, "f32"))
        growth = f"{f32['ms'] / half['ms']:.2f}x" if half else "-"
        cells = [str(n), f"{f32['ms']:.2f}", f"{f32['gflops']:.0f}",
                 f"{f32['gflops'] / f32['matmul_gflops']:.0%}", growth,
                 f"{f32['scratch_mb']:.0f}"]
        cells += [f"{bf16['ms']:.2f}", f"{bf16['gflops']:.0f}"] if bf16 else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- per-call overhead

def overhead_sweep(args):
    """{(dtype, kind, runtime_dims): (cold_us, warm_us, allocations of ours, allocations
    inside oneDNN's execute, executes)} per warm call, from mha_bench --overhead."""
    results = {}
    for runtime in (True, False):
        flags = [f"--runtime_dims_max_scores={4 * 128 * 128 if runtime else 0}"]
        out = subprocess.run([args.mha_bench, "--overhead", "--json", "--dtypes=f32,bf16"] + flags,
                             check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                kind = r["name"].replace("overhead_", "")
                results[(r["dtype"], kind, runtime)] = (
                    r["cold_us"], r["warm_us"], r["warm_allocations_ours"],
                    r["warm_allocations_onednn"], r["warm_executes"])
    return results


def overhead_table(results):
    lines = ["| compute | attention | per-shape primitives: first call us | warm us | "
             "runtime-shape primitive: first call us | warm us | "
             "warm allocations: ours / in oneDNN execute (executes) |",
             "|---|---|---|---|---|---|---|"]
    for dtype in ("f32", "bf16"):
        for kind in ("self", "cross"):
            a, b = results[(dtype, kind, False)], results[(dtype, kind, True)]
            allocations = " · ".join(f"{r[2]:.0f} / {r[3]:.0f} ({r[4]:.1f})" for r in (a, b))
            lines.append(f"| {dtype} | {kind} | {a[0]:.0f} | {a[1]:.0f} | "
                         f"{b[0]:.0f} | {b[1]:.0f} | {allocations} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- sessions (decode)

def decode_runs(args, runs=3):
    """The rows of `mha_bench --decode --json`, `runs` times: [{name: row}]."""
    results = []
    for _ in range(runs):
        out = subprocess.run([args.mha_bench, "--decode", "--json"], check=True,
                             capture_output=True, text=True).stdout
        results.append({r["name"]: r for r in map(json.loads, filter(None, out.splitlines()))})
    return results


def decode_table(runs):
    """One line per row: the range over the runs of its time, its ratio (against
    its target) and, for rows that read the cache, its rate and share of the probe."""
    def span(values, fmt):
        lo, hi = min(values), max(values)
        return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else \
            f"{fmt.format(lo)}–{fmt.format(hi)}"
    probe = span([r["read_bandwidth_probe"]["gb_per_s"] for r in runs], "{:.0f}")
    lines = [f"Read-bandwidth probe (a streaming sum of 256 MiB on the same threads): {probe} GB/s.",
             "", "| row | ms | ratio (target) | cache read at GB/s | of the probe |",
             "|---|---|---|---|---|"]
    for name, first in runs[0].items():
        if name == "read_bandwidth_probe":
            continue
        rows = [r[name] for r in runs]
        what = next(k for k in first if k not in (
            "name", "ms", "target", "kv_bytes", "kv_gb_per_s", "probe_gb_per_s", "of_probe"))
        rate = span([r["kv_gb_per_s"] for r in rows], "{:.0f}") if "kv_gb_per_s" in first else ""
        share = span([100 * r["of_probe"] for r in rows], "{:.0f} %") if "of_probe" in first \
            else ""
        lines.append(f"| `{name}` | {span([r['ms'] for r in rows], '{:.2f}')} | "
                     f"{what} {span([r[what] for r in rows], '{:.2f}')}× ({first['target']:g}×) | "
                     f"{rate} | {share} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- server

def load_sweep(args, flags, len_range="16:128", concurrency=CONCURRENCY):
    """{concurrency: row of mha_client's sweep CSV} for a server with `flags`."""
    prefix = os.path.join(args.out_dir, ".sweep")
    with LocalServer(args.mha_server, os.path.join(ROOT, "models"), flags) as server:
        subprocess.run([args.mha_client, "load", f"--target={server.target()}", "--model=demo",
                        f"--sweep={','.join(map(str, concurrency))}", f"--len_range={len_range}",
                        f"--duration={args.server_seconds}s", f"--sweep_out={prefix}"],
                       check=True, capture_output=True)
    with open(prefix + ".csv") as f:
        rows = list(csv.DictReader(f))
    for suffix in (".csv", ".svg"):
        os.unlink(prefix + suffix)
    return {int(r["concurrency"]): r for r in rows}


def server_sweep(args, batching):
    return load_sweep(args, [] if batching else ["--disable_batching"])


# (--workers, --intra_op_threads) tried, and the loads they are tried on.
THREAD_CONFIGS = [(2, 0), (1, 2), (2, 1), (1, 1)]
THREAD_LOADS = [("small, L = 16", "16:16"), ("large, L = 512", "512:512")]
THREAD_CONCURRENCY = [1, 16]


def thread_sweep(args):
    """{(workers, threads, load name): {concurrency: row}}."""
    return {(w, t, name): load_sweep(args, [f"--workers={w}", f"--intra_op_threads={t}"],
                                     lengths, THREAD_CONCURRENCY)
            for w, t in THREAD_CONFIGS for name, lengths in THREAD_LOADS}


def thread_table(results):
    head = ["--workers", "--intra_op_threads"]
    for name, _ in THREAD_LOADS:
        for c in THREAD_CONCURRENCY:
            head += [f"{name}, c={c}: req/s", "p50 ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w, t in THREAD_CONFIGS:
        cells = [str(w), str(t) if t else "0 (the free cores)"]
        for name, _ in THREAD_LOADS:
            for c in THREAD_CONCURRENCY:
                r = results[(w, t, name)][c]
                cells += [f"{float(r['rps']):.0f}", f"{float(r['p50_ms']):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def server_table(on, off):
    lines = ["| concurrency | batching on req/s | p50 ms | p99 ms | batching off req/s | "
             "p50 ms | p99 ms | on / off |", "|---|---|---|---|---|---|---|---|"]
    for c in CONCURRENCY:
        a, b = on[c], off[c]
        lines.append(f"| {c} | {float(a['rps']):.0f} | {float(a['p50_ms']):.2f} | "
                     f"{float(a['p99_ms']):.2f} | {float(b['rps']):.0f} | "
                     f"{float(b['p50_ms']):.2f} | {float(b['p99_ms']):.2f} | "
                     f"{float(a['rps']) / float(b['rps']):.2f}x |")
    return "\n".join(lines)


def cpu_table(runs):
    lines = ["| run | server CPU per request | mean batch (requests) | engine CPU per request "
             "on that batch | ratio | requests/s |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r['server_cpu_us']:.0f} µs | {r['mean_batch']:.1f} | "
                     f"{r['engine_cpu_us']:.0f} µs | {r['ratio']:.2f}x | {r['rps']:.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- report

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    build = os.path.join(ROOT, "build")
    parser.add_argument("--mha_bench", default=os.path.join(build, "mha_bench"))
    parser.add_argument("--mha_server", default=os.path.join(build, "mha_server"))
    parser.add_argument("--mha_client", default=os.path.join(build, "mha_client"))
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "docs"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server_seconds", type=float, default=5)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    print("standard shapes", file=sys.stderr, flush=True)
    std = run_bench.collect(argparse.Namespace(
        rounds=args.rounds, mha_bench=args.mha_bench, shapes="", min_seconds=0.3,
        torch_modes="best,default"))
    print("wider models", file=sys.stderr, flush=True)
    wide = run_bench.collect(argparse.Namespace(
        rounds=3, mha_bench=args.mha_bench, shapes="", min_seconds=0.3, min_reps=3, wide=True,
        torch_modes="best,default"))
    print("per-call overhead", file=sys.stderr, flush=True)
    overhead = overhead_sweep(args)
    print("sessions (decode)", file=sys.stderr, flush=True)
    decode = decode_runs(args)
    print("sequence lengths", file=sys.stderr, flush=True)
    series, ours = sequence_sweep(args)
    print("server", file=sys.stderr, flush=True)
    on, off = server_sweep(args, True), server_sweep(args, False)
    print("threads", file=sys.stderr, flush=True)
    threads = thread_sweep(args)
    print("server CPU per request", file=sys.stderr, flush=True)
    cpu = [server_cpu.measure(argparse.Namespace(
        mha_server=args.mha_server, mha_client=args.mha_client, mha_bench=args.mha_bench,
        concurrency=64, seconds=10, rounds=5)) for _ in range(3)]

    with open(os.path.join(args.out_dir, "perf_seq_len.svg"), "w") as f:
        f.write(line_chart("Self-attention, B=1, E=512, h=8", "sequence length L", "GFLOP/s",
                           series, log_x=True))
    with open(os.path.join(args.out_dir, "perf_server.svg"), "w") as f:
        f.write(line_chart(
            "Server, demo model (E=256, h=4), L uniform in [16, 128]", "concurrent requests",
            "requests/s", {"batching on": {c: float(r["rps"]) for c, r in on.items()},
                           "batching off": {c: float(r["rps"]) for c, r in off.items()}},
            log_x=True))
    ratios = [run_bench.median_of(d["f32"], "ms") /
              min(run_bench.median_of(d[k], "ms") for k in ("torch_best", "torch_default"))
              for d in std.values() if d.get("torch_best") and d.get("torch_default")]
    text = TEMPLATE.format(
        date=datetime.date.today().isoformat(), machine=machine(),
        standard=standard_table(std), wide=standard_table(wide), sequence=sequence_table(ours),
        server=server_table(on, off), threads=thread_table(threads),
        overhead=overhead_table(overhead), decode=decode_table(decode), cpu=cpu_table(cpu), worst=max(ratios), best=min(ratios),
        median=statistics.median(ratios))
    with open(os.path.join(args.out_dir, "performance_report.md"), "w") as f:
        f.write(text)
    print(f"wrote {os.path.join(args.out_dir, 'performance_report.md')}", file=sys.stderr)


TEMPLATE = """# Performance

Generated by `/usr/bin/python3 tests/bench/performance_report.py` on {date}.
Machine: {machine}. Every number below comes from that one run; the machines
here are shared and their speed drifts by tens of percent from hour to hour,
so compare the ratios (taken in the same run, same threads), not the
absolute times.

FLOPs count the projections and the two attention products (QK^T, PV), as
`torch.nn.MultiheadAttention` computes them; "matmul" is a plain oneDNN
1024 x 1024 x 1024 product measured right before each shape (this machine's
ceiling at that moment). PyTorch is Debian's `python3-torch` with
`need_weights=False`, in two configurations: *default* (Debian's settings,
main thread) and *tuned* (2 threads, timed from a worker thread after a
warm-up, `OPENBLAS_CORETYPE=SkylakeX`). Both engines use the 2 cores.

## Standard shapes

Medians of {rounds_note}. The last column is our fp32 time over PyTorch's
best of its two configurations: below 1 is faster (here {best:.2f} to
{worst:.2f}, median {median:.2f}).

{standard}

## Wider models

The same measurement (3 rounds) for E = 1024 to 2048 and h = 16 to 32:
the fraction of the matmul rate and the lead over PyTorch should hold as
models grow.

{wide}

## Small requests: per-call time, new shapes and warm

`mha_bench --overhead`: one request at a time (B = 1, E = 256, h = 4, as a
server without batching runs them), every query length from 17 to 128 once
("first call": each new length may need new oneDNN primitives) and then
again ("warm": everything cached; mean per call). Cross-attention pairs
each length with another key length. Measured both ways: a primitive per
block shape, created at first use and cached, and (for blocks up to
4 x 128 x 128 scores) one primitive with runtime shapes created with the
engine (and at warm-up for each thread count calls use). The engine uses the runtime-shape primitive in fp32 and
per-shape ones in bf16 (with AMX those run faster once created). Either way a
first call also creates the projections' primitives for its row count
(one per count below 64, then powers of two: bounded, created once).
Steady-state calls allocate nothing of ours: workspace buffers are reused
and each workspace keeps the oneDNN memory objects of the primitives it
ran, re-pointing them at each call's buffers (tests/engine/engine_alloc_test.cc
asserts zero). What remains are the `operator new` calls oneDNN 2.6 makes
inside every `dnnl_primitive_execute` (it builds an argument map per call;
counted through a link-time wrapper), shown per warm call with the mean
number of executes (per-shape · runtime-shape).

{overhead}

## Sequence length

Self-attention, one sequence, E = 512, h = 8, no weights asked for. From
L = 512 on, ours runs key-tiled with an online softmax: blocks of 512
query rows of one head stream their keys 512 at a time (a tile's scores
stay in L2), the blocks shared out among the threads; shorter ones run in
blocks of query rows whose scores fit 4 MiB. Either way scratch memory
stays bounded at any length (never the L x L matrix of all heads;
"scratch" is every buffer the engine held, projections included); PyTorch
is measured up to L = 4096 (at 16384 it would hold 8.6 GB of scores). Time
should grow 4x per doubling of L once the L^2 attention dominates.

![GFLOP/s against sequence length](perf_seq_len.svg)

{sequence}

## Sessions (decode)

`mha_bench --decode`, three runs (E = 512, h = 8, fp32 compute): one step of
one token over a cache of 4096 tokens (the steps rotate over 64 MiB of
sessions, so each reads memory; then one session again and again, which
stays in the L3) against the causal pass over all 4097 tokens; 64 sessions
stepping one token each, in one batched call against one call each, at
cached lengths 64 and 1024, over an fp32, a bf16 and an int8 cache, and the
same batches over 1-token caches (what a step costs apart from its cache
reads; those nine timings taken in alternation, so they share the machine's
drift), the speedups of each cache dtype and of its reads alone (a row
minus its 1-token row, against the bytes' ratio); and steps riding in an
Attend call against two calls. A step reads every cached key and value
once: its limit is the memory's read bandwidth, hence the probe (the best
of 7 passes).

{decode}

## Server

`mha_client load --sweep` against a local `mha_server` on the demo model,
query lengths uniform in [16, 128], closed loop; the client runs on the same
2 cores as the server, so these are lower bounds of what a separate client
machine would see. Batching on: the default continuous batching; off:
`--disable_batching`.

![Throughput against concurrency](perf_server.svg)

{server}

## Threads

The same server and client with batching on, for each split of the 2 cores
between engine workers (`--workers`, requests computed at once) and threads
per engine call (`--intra_op_threads`), on small (L = 16) and large
(L = 512) requests at 1 and 16 concurrent clients.

{threads}

## The server around the engine

What the server costs beyond the engine (`tests/bench/server_cpu.py`, three runs): the server's
CPU time (user + system from `/proc/PID/stat`) per request answered under `mha_client load
--concurrency 64 --len_range 16:128` (batching on, demo model), against the engine's CPU time
per request on ragged batches of the size the server formed (`mha_bench --shapes ragged
--ragged_batch N`: wall time x threads / N, a spinning OpenMP thread counted as in the
server, with the threads a call gets under this load: 1, its share of the cores beside the
other worker's call). The client shares the 2 cores.

{cpu}
""".replace("{rounds_note}", "3 rounds, alternating the programs")


if __name__ == "__main__":
    main()
