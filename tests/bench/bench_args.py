"""What the server benchmarks share: the repository's root, and an
argument parser that knows where the mha_server to measure is."""

import argparse
import os

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def server_bench_parser(description=None, **counts):
    """An ArgumentParser with --mha_server (default: build/mha_server) and
    an integer option --NAME for each NAME=default of `counts`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--mha_server", default=os.path.join(ROOT, "build", "mha_server"),
                        help="the server binary to measure")
    for name, default in counts.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    return parser
