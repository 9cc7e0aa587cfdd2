#!/usr/bin/python3
"""Runs clang's lock analysis on the sources of engine/, server/, client/
and proto/ that a clang build has not compiled (the fuzz build compiles only
what its targets link): each with its own flags from the build's
compile_commands.json, -fsyntax-only (the analysis, no code generation).
The flags carry -Werror=thread-safety (CMakeLists.txt), so an unguarded
read fails here as it fails in a compile.

    check_locks_unbuilt.py BUILD_DIR
"""

import concurrent.futures
import json
import os
import shlex
import subprocess
import sys

CHECKED = ("engine", "server", "client", "proto")


def syntax_only(entry):
    """The entry's compile command without its output, as -fsyntax-only."""
    args = shlex.split(entry["command"])
    out = args.index("-o")
    del args[out:out + 2]
    return args + ["-fsyntax-only"]


def source_dir(build):
    """The source tree BUILD_DIR was configured from."""
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith("CMAKE_HOME_DIRECTORY:"):
                return line.split("=", 1)[1].strip()
    raise SystemExit(f"{build}: no CMAKE_HOME_DIRECTORY in CMakeCache.txt")


def main():
    build = os.path.abspath(sys.argv[1])
    root = source_dir(build)
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = json.load(f)
    todo = []
    for e in entries:
        source = os.path.relpath(e["file"], root)
        args = shlex.split(e["command"])
        built = os.path.join(e["directory"], args[args.index("-o") + 1])
        if source.split(os.sep)[0] in CHECKED and not os.path.exists(built):
            todo.append(e)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        runs = list(pool.map(
            lambda e: subprocess.run(syntax_only(e), cwd=e["directory"], capture_output=True,
                                     text=True), todo))
    failed = [(e, r) for e, r in zip(todo, runs) if r.returncode != 0]
    for e, r in failed:
        print(f"{os.path.relpath(e['file'], root)}:\n{r.stdout}{r.stderr}", file=sys.stderr)
    print(f"lock analysis: {len(todo)} sources the build did not compile, "
          f"{len(failed)} failed")
    return 1 if failed or not todo else 0


if __name__ == "__main__":
    sys.exit(main())
