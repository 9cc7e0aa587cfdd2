#!/usr/bin/python3
"""Writes an --input-data file for Triton's perf_analyzer: the `query` input
of a model, and nothing else.

perf_analyzer makes up data for every input of a model's config, the
optional ones too (`key`, `value`, `key_padding_mask`, `attn_mask` here),
and stops on their dynamic shapes. A JSON file that holds only the query
makes it send self-attention requests of the shape in the file, which is
what `--shape query:L,E` alone is meant to do. Each entry of "data" is one
request's query [L, E] (the batch dimension is perf_analyzer's `-b`).

    python3 client/perf_analyzer/make_input_data.py --lengths 64 --embed_dim 256 \
        > client/perf_analyzer/demo_64x256.json
    perf_analyzer -m demo -i grpc -u localhost:50051 -b 1 \
        --input-data client/perf_analyzer/demo_64x256.json

Several --lengths (e.g. 16,64,128) give one entry each, sent in turn.
Values are seeded normal samples with 3 decimals, so a file is reproducible.
"""

import argparse
import json
import random
import sys


def input_data(lengths, embed_dim, seed=0):
    """perf_analyzer's input-data document: one query entry per length."""
    rng = random.Random(seed)
    entries = []
    for length in lengths:
        content = [round(rng.gauss(0.0, 1.0), 3) for _ in range(length * embed_dim)]
        entries.append({"query": {"content": content, "shape": [length, embed_dim]}})
    return {"data": entries}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64",
                        help="comma-separated query lengths, one entry each (default 64)")
    parser.add_argument("--embed_dim", type=int, default=256,
                        help="the model's embed_dim (default 256: the demo model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: not a list of integers: {args.lengths!r}")
    if any(n < 1 for n in lengths) or args.embed_dim < 1:
        parser.error("lengths and --embed_dim must be at least 1")
    json.dump(input_data(lengths, args.embed_dim, args.seed), sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
