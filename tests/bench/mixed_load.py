#!/usr/bin/python3
"""Session steps under Attend load: step latency and Attend throughput, alone
and together, for values of the per-model knob
`dynamic_batching.max_batch_tokens_with_steps`.

    /usr/bin/python3 tests/bench/mixed_load.py [--caps=default,256,512,1024,0] [--seconds=5]
        [--len_range=64:128] [--server_flags="--workers=1"] [--whole_len=1024] [--wakeups]

For each cap, one server on a copy of the demo model with that cap:
1. Attend alone: `mha_client load --concurrency 16 --len_range 64:128` (or --len_range:
   requests longer than the cap go in chunks beside the steps).
2. Steps alone: `mha_client load --sessions 16 --steps S` (unary part).
3. Both at once: the Attend load starts, and runs for longer than the
   sessions' steps, which start a second later; every mixed figure is taken
   over the steps' own run (the Attend req/s from the server's
   mha_requests_total over that window, not the Attend client's whole run).
Prints one JSON object per cap: step p50/p99 alone and under load seen from
the client (unary part) and their ratio, the server's own step p99 (enqueue
to answer, mha_append_duration_seconds) and its wait for a call
(mha_append_queue_duration_seconds) over the same windows, Attend req/s
alone and under load and its share. The clients run on the server's cores,
so compare figures of one run only.

It also splits the server's wait for a call by the workers when each step
was queued (mha_append_queue_split_duration_seconds: every worker in a call,
or one free to wake), and says where the two cores went over each steps'
window and the Attend load alone ("cpu_*": the share of the machine taken by
the server's workers, its other threads (gRPC's), the steps' client and the
Attend client; CPU microseconds a step of the steps' client and of the
server's gRPC threads, and of the workers an Attend request alone).

With --whole_len L, one more phase per cap ("beside_whole"): the steps while
one client sends 1 x L causal requests back to back. Those cannot go in
chunks, so they run whole beside the steps: a step either goes to the free
worker or runs inside the long call, between its blocks (its yield,
mha_yielded_step_calls_total, counted over the window as "yielded_step_calls").

With --wakeups, a thread of the clients' priority also sleeps 1 ms at a time
through every steps' window, and "wakeup_late_p99_ms" says how late it woke
at p99 (idle, beside Attend): what the machine's scheduler costs each of the
hand-offs between threads a step makes (client, gRPC, worker, client). Off
by default: it is one more thread on the cores.
"""

import argparse
import json
import multiprocessing
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from mha_local_server import LocalServer  # noqa: E402

sys.path.insert(0, HERE)
from server_cpu import scrape  # noqa: E402

STEPS_LINE = re.compile(r"^unary .*?([\d.]+) tokens/s; per step p50 ([\d.]+) ms, p90 [\d.]+ ms, "
                        r"p99 ([\d.]+) ms", re.M)
ATTEND_LINE = re.compile(r"^requests \d+ in [\d.]+ s: ([\d.]+) req/s", re.M)


def repository_with_cap(cap):
    """A temporary repository holding the demo model, with `cap` set."""
    repo = tempfile.mkdtemp(prefix="mha_mixed_")
    shutil.copytree(os.path.join(ROOT, "models", "demo"), os.path.join(repo, "demo"))
    if cap != "default":
        with open(os.path.join(repo, "demo", "config.pbtxt"), "a") as f:
            f.write(f"\ndynamic_batching {{ max_batch_tokens_with_steps: {cap} }}\n")
    return repo


def attend_load(args, target, seconds):
    return subprocess.Popen([args.mha_client, "load", f"--target={target}", "--model=demo",
                             "--concurrency=16", f"--len_range={args.len_range}",
                             f"--duration={seconds}s"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def steps_load(args, target):
    return subprocess.Popen([args.mha_client, "load", f"--target={target}", "--model=demo",
                             "--sessions=16", f"--steps={args.steps}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def whole_load(target, length):
    """1 x `length` causal Attend requests back to back (in a process of
    its own: the Python client's encoding does not share this one's GIL)."""
    import numpy as np
    import mha_client
    query = np.random.default_rng(1).standard_normal((1, length, 256)).astype(np.float32)
    with mha_client.MhaClient(target) as client:
        while True:
            client.attend("demo", query, is_causal=True)


# Sleeps 1 ms at a time until SIGTERM, then prints how late it woke at p99 (ms).
WAKEUP_PROBE = """
import signal, time
stop, late = [], []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    due = time.monotonic() + 0.001
    time.sleep(0.001)
    late.append(time.monotonic() - due)
late.sort()
print(1e3 * late[int(0.99 * (len(late) - 1))])
"""


class WakeupProbe:
    """How late a sleeping thread of the clients' priority wakes, over a
    window (None when not asked for)."""

    def __init__(self, enabled):
        self.process = subprocess.Popen([sys.executable, "-c", WAKEUP_PROBE],
                                        stdout=subprocess.PIPE, text=True) if enabled else None

    def stop(self):
        if self.process is None:
            return None
        self.process.terminate()
        return round(float(self.process.communicate()[0]), 3)


def parse(pattern, process):
    out = process.communicate()[0]
    found = pattern.search(out)
    if process.returncode != 0 or found is None:
        raise RuntimeError(f"load client failed: {out}")
    return [float(x) for x in found.groups()]


def histogram_quantile(before, after, name, q, labels=""):
    """The q-quantile (seconds) of histogram `name` (the series of `labels`,
    e.g. 'workers="all_busy",') over what was observed between two scrapes:
    the upper bound of the bucket holding it."""
    pattern = re.compile(rf'^{name}_bucket{{{labels}le="([^"]+)"}} (\S+)$', re.M)
    b = {le: float(v) for le, v in pattern.findall(before)}
    rows = [(float(le), float(v) - b.get(le, 0.0)) for le, v in pattern.findall(after)]
    rows.sort()
    total = rows[-1][1] if rows else 0.0
    for le, count in rows:
        if total and count >= q * total:
            return le
    return float("nan")


def attend_requests(metrics):
    """Attend requests answered so far (session steps are not requests)."""
    pattern = re.compile(r'^mha_requests_total\{api="mha\.v1",code="OK"[^}]*\} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(metrics))


def counter_sum(text, name):
    """The sum of every series of counter `name`."""
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


def sample(text, name):
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def thread_cpu(pid):
    """{thread id: (name, user + system CPU seconds)} of process `pid`."""
    threads = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        threads[tid] = (stat[stat.index("(") + 1:stat.rindex(")")],
                        (int(fields[11]) + int(fields[12])) / tick)
    return threads


def cpu_used(before, after, workers):
    """CPU seconds between two thread_cpu snapshots: the threads whose name
    `workers` says, and the others."""
    split = [0.0, 0.0]
    for tid, (name, seconds) in after.items():
        split[0 if workers(name) else 1] += seconds - before.get(tid, (name, 0.0))[1]
    return split


class CoresUsed:
    """Where the cores go from its making to `stop`: the server's workers and
    its other threads (gRPC's), the clients this process reaps meanwhile,
    and the threads of the running process `other` (the Attend client)."""

    def __init__(self, server_pid, other_pid=None):
        self.server_pid, self.other_pid = server_pid, other_pid
        self.children = self.reaped()
        self.server = thread_cpu(server_pid)
        self.other = thread_cpu(other_pid) if other_pid else {}
        self.start = time.monotonic()

    @staticmethod
    def reaped():
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def stop(self):
        """CPU seconds (workers, server's others, reaped clients, other) and
        the CPU seconds in 1 % of the machine over the window."""
        machine = (time.monotonic() - self.start) * (os.cpu_count() or 1) / 100
        workers, grpc = cpu_used(self.server, thread_cpu(self.server_pid),
                                 lambda name: name.startswith("mha-worker"))
        other = sum(cpu_used(self.other, thread_cpu(self.other_pid), bool)) if self.other_pid else 0
        return workers, grpc, self.reaped() - self.children, other, machine


def steps_window(args, server, target, attend=None):
    """Runs the 16 sessions' steps once: (client tokens/s, p50, p99 ms), the
    server's step p99 and queue p99 (ms) and the Attend requests/s it served
    over exactly that window, and where the cores went (the Attend client's
    threads counted when `attend` runs)."""
    cores = CoresUsed(server.process.pid, attend.pid if attend else None)
    wakeups = WakeupProbe(args.wakeups)
    before, start = scrape(server.metrics_port), time.monotonic()
    tokens_s, p50, p99 = parse(STEPS_LINE, steps_load(args, target))  # the client, reaped
    after, wall = scrape(server.metrics_port), time.monotonic() - start
    wakeup_late_p99 = wakeups.stop()
    workers, grpc, client_s, attend_s, machine = cores.stop()
    step, queue = "mha_append_duration_seconds", "mha_append_queue_duration_seconds"
    split = "mha_append_queue_split_duration_seconds"
    busy = (sample(after, f'{split}_count{{workers="all_busy"}}') -
            sample(before, f'{split}_count{{workers="all_busy"}}'))
    steps = sample(after, f"{queue}_count") - sample(before, f"{queue}_count")
    return {"tokens_s": tokens_s, "p50": p50, "p99": p99, "wakeup_late_p99": wakeup_late_p99,
            "queued_behind_calls": round(busy / steps, 3) if steps else float("nan"),
            "queue_p99_behind_calls": 1e3 * histogram_quantile(before, after, split, 0.99,
                                                               'workers="all_busy",'),
            "queue_p99_worker_free": 1e3 * histogram_quantile(before, after, split, 0.99,
                                                              'workers="some_free",'),
            "cpu": {"server_workers_pct": round(workers / machine, 1),
                    "server_other_threads_pct": round(grpc / machine, 1),
                    "steps_client_pct": round(client_s / machine, 1),
                    "attend_client_pct": round(attend_s / machine, 1),
                    "steps_client_us_per_step": round(1e6 * client_s / steps, 1) if steps else 0,
                    "server_other_threads_us_per_step":
                        round(1e6 * grpc / steps, 1) if steps and not attend else None},
            "server_p50": 1e3 * histogram_quantile(before, after, step, 0.5),
            "server_p99": 1e3 * histogram_quantile(before, after, step, 0.99),
            "server_queue_p50": 1e3 * histogram_quantile(before, after, queue, 0.5),
            "server_queue_p99": 1e3 * histogram_quantile(before, after, queue, 0.99),
            "yielded_step_calls": (counter_sum(after, "mha_yielded_step_calls_total") -
                                   counter_sum(before, "mha_yielded_step_calls_total")),
            "attend_rps": (attend_requests(after) - attend_requests(before)) / wall}


def attend_alone(args, server, target):
    """The Attend load alone: its requests/s, and where the cores went."""
    cores = CoresUsed(server.process.pid)
    before, start = scrape(server.metrics_port), time.monotonic()
    parse(ATTEND_LINE, attend_load(args, target, args.seconds))
    after, wall = scrape(server.metrics_port), time.monotonic() - start
    workers, grpc, client_s, _, machine = cores.stop()
    requests = attend_requests(after) - attend_requests(before)
    return requests / wall, {"server_workers_pct": round(workers / machine, 1),
                             "server_other_threads_pct": round(grpc / machine, 1),
                             "attend_client_pct": round(client_s / machine, 1),
                             "server_workers_us_per_request": round(1e6 * workers / requests, 1)}


def measure(args, cap):
    """Attend alone, steps alone, then the steps while the Attend load runs
    for longer than they do, so that both figures of the mixed phase are
    taken over the same window (the steps' own run)."""
    repo = repository_with_cap(cap)
    try:
        with LocalServer(args.mha_server, repo, shlex.split(args.server_flags)) as server:
            target = server.target()
            parse(ATTEND_LINE, attend_load(args, target, 2))  # warm-up
            parse(STEPS_LINE, steps_load(args, target))
            solo_rps, solo_cpu = attend_alone(args, server, target)
            idle = steps_window(args, server, target)
            attend = attend_load(args, target, 3600)
            time.sleep(1.0)  # the Attend load is in full swing
            mixed = steps_window(args, server, target, attend)
            attend.kill()
            attend.communicate()
            whole = beside_whole(args, server, target, idle) if args.whole_len else None
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    return {"cap": cap, "len_range": args.len_range,
            "step_idle_p50_ms": idle["p50"], "step_idle_p99_ms": idle["p99"],
            "step_mixed_p50_ms": mixed["p50"], "step_mixed_p99_ms": mixed["p99"],
            "step_p99_ratio": round(mixed["p99"] / idle["p99"], 2),
            "server_step_p50_ms": [idle["server_p50"], mixed["server_p50"]],
            "server_step_p99_ms": [idle["server_p99"], mixed["server_p99"]],
            "server_step_p99_ratio": round(mixed["server_p99"] / idle["server_p99"], 2),
            "server_step_queue_p50_ms": [idle["server_queue_p50"], mixed["server_queue_p50"]],
            "server_step_queue_p99_ms": [idle["server_queue_p99"], mixed["server_queue_p99"]],
            "step_tokens_s_mixed": mixed["tokens_s"],
            "wakeup_late_p99_ms": [idle["wakeup_late_p99"], mixed["wakeup_late_p99"]],
            "steps_queued_behind_calls": [idle["queued_behind_calls"],
                                          mixed["queued_behind_calls"]],
            "server_step_queue_p99_behind_calls_ms": [idle["queue_p99_behind_calls"],
                                                      mixed["queue_p99_behind_calls"]],
            "server_step_queue_p99_worker_free_ms": [idle["queue_p99_worker_free"],
                                                     mixed["queue_p99_worker_free"]],
            "cpu_attend_alone": solo_cpu, "cpu_steps_alone": idle["cpu"], "cpu_mixed": mixed["cpu"],
            "attend_solo_rps": round(solo_rps, 1), "attend_mixed_rps": round(mixed["attend_rps"], 1),
            "attend_share": round(mixed["attend_rps"] / solo_rps, 3),
            "yielded_step_calls_mixed": mixed["yielded_step_calls"], "beside_whole": whole}


def beside_whole(args, server, target, idle):
    """The steps while 1 x whole_len causal requests run whole beside them."""
    load = multiprocessing.get_context("spawn").Process(  # no fork of gRPC state
        target=whole_load, args=(target, args.whole_len), daemon=True)
    load.start()
    try:
        time.sleep(1.0)  # the requests are in full swing
        steps = steps_window(args, server, target, load)
    finally:
        load.terminate()
        load.join()
    return {"len": args.whole_len, "step_p99_ms": steps["p99"],
            "step_p99_ratio": round(steps["p99"] / idle["p99"], 2),
            "server_step_p99_ms": steps["server_p99"],
            "server_step_p99_ratio": round(steps["server_p99"] / idle["server_p99"], 2),
            "server_step_queue_p99_ms": steps["server_queue_p99"],
            "yielded_step_calls": steps["yielded_step_calls"],
            "whole_rps": round(steps["attend_rps"], 1)}


def main():
    build = os.path.join(ROOT, "build")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mha_server", default=os.path.join(build, "mha_server"))
    parser.add_argument("--mha_client", default=os.path.join(build, "mha_client"))
    parser.add_argument("--caps", default="default,256,512,1024,0",
                        help="values of max_batch_tokens_with_steps (0: no cap)")
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--steps", type=int, default=600, help="steps per session")
    parser.add_argument("--len_range", default="64:128", help="Attend lengths, MIN:MAX")
    parser.add_argument("--whole_len", type=int, default=0,
                        help="also measure the steps beside 1 x L causal requests (0: not)")
    parser.add_argument("--wakeups", action="store_true",
                        help="also time a sleeping thread's wake-ups through the steps' windows")
    parser.add_argument("--server_flags", default="", help="more flags for mha_server")
    args = parser.parse_args()
    for cap in args.caps.split(","):
        print(json.dumps(measure(args, cap)), flush=True)


if __name__ == "__main__":
    main()
