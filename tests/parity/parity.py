#!/usr/bin/python3
"""Parity test of mha_run (or mha_server) against a PyTorch reference.

For each configuration (see parity_cases.py) this writes a model folder
(config.pbtxt + weights.safetensors) and an inputs file, runs mha_run and
compares its outputs with a float64 torch reference (mha_reference.py).

With --server instead of --mha_run, every configuration's model folder goes
into one model repository (folders case000, case001, ...), one mha_server
serves them all, and each configuration is one Attend call carrying the
tensors and flags mha_run would get (see parity_server.py).

  python3 tests/parity/parity.py --mha_run build/mha_run [--configs 60]
      [--seed 0] [--workdir DIR] [--keep] [--only 3,7-9]
  python3 tests/parity/parity.py --server build/mha_server [same options]
  python3 tests/parity/parity.py --write-demo models/demo

Tolerances: fp32 compute, max abs error <= 1e-5; bf16 compute, max abs
error / max |reference| <= 2e-2; int8 compute (int8 projections), max abs
error / max(1, max |reference|) <= 2e-2 (for the output and the attention
weights separately). Exit code 0 only if every configuration passes.
"""

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mha_model_io import (Enum, format_pbtxt, params_to_tensors,  # noqa: E402
                          read_safetensors, round_to_dtype, tensors_to_params,
                          write_safetensors)
from mha_reference import reference_mha  # noqa: E402
from parity_cases import describe, make_case  # noqa: E402

FP32_ABS_TOL = 1e-5
BF16_REL_TOL = 2e-2
INT8_REL_TOL = 2e-2
RUN_TIMEOUT_S = 120


# ----------------------------------------------------------------- model

def make_params(c, gen):
    """Random canonical parameters for case c (float32 numpy arrays).

    Weights follow nn.Linear's default scale; biases, bias_k/v and the
    LayerNorm affine are random too (PyTorch initialises several of them to
    zero or one, which would hide mix-ups between tensors)."""
    dk = c.dk or c.E // c.h
    dv = c.dv or c.E // c.h

    def linear(out_features, in_features):
        bound = 1.0 / math.sqrt(in_features)
        w = (torch.rand(out_features, in_features, generator=gen) * 2 - 1)
        return (w * bound).numpy(), (torch.randn(out_features, generator=gen)
                                     * 0.2).numpy()

    p = {}
    p["wq"], p["bq"] = linear(c.h * dk, c.E)
    p["wk"], p["bk"] = linear(c.h * dk, c.kdim)
    p["wv"], p["bv"] = linear(c.h * dv, c.vdim)
    p["wo"], p["bo"] = linear(c.E, c.h * dv)
    if not c.bias:
        p["bq"] = p["bk"] = p["bv"] = p["bo"] = None
    p["bias_k"] = p["bias_v"] = p["norm_w"] = p["norm_b"] = None
    if c.add_bias_kv:
        p["bias_k"] = (torch.randn(1, 1, c.h * dk, generator=gen) * 0.5).numpy()
        p["bias_v"] = (torch.randn(1, 1, c.h * dv, generator=gen) * 0.5).numpy()
    if c.norm_eps is not None:
        p["norm_w"] = (1 + 0.3 * torch.randn(c.E, generator=gen)).numpy()
        p["norm_b"] = (0.2 * torch.randn(c.E, generator=gen)).numpy()
    return p


def write_model(c, params, model_dir, r):
    """Writes config.pbtxt and weights.safetensors; returns the canonical
    parameters as mha_run will see them (rounded to the storage dtypes)."""
    os.makedirs(model_dir, exist_ok=True)
    canonical = params_to_tensors(params, c.layout, c.h)
    dtypes = {name: _storage_dtype(c.wdtype, r) for name in canonical}
    rounded = {n: round_to_dtype(a, dtypes[n]) for n, a in canonical.items()}
    renames = _renames(c, canonical)

    stored = {}
    for name, array in rounded.items():
        stored[c.prefix + renames.get(name, name)] = (array, dtypes[name])
    _add_decoys(c, canonical, renames, stored, r)
    write_safetensors(os.path.join(model_dir, "weights.safetensors"), stored,
                      metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
        f.write(format_pbtxt(config_message(c, renames)))
    return tensors_to_params(rounded, c.layout, c.h)


def _storage_dtype(wdtype, r):
    return r.choice(["F32", "F16", "BF16"]) if wdtype == "mixed" else wdtype


def _renames(c, canonical):
    """Some canonical tensors (weights and biases) get checkpoint-specific
    names."""
    if not c.rename:
        return {}
    names = set(sorted(canonical)[::3]) | {"out_proj.weight"}
    return {n: "ckpt/" + n.replace(".", "_") + "_renamed" for n in names}


def _add_decoys(c, canonical, renames, stored, r):
    """Tensors that must NOT be used: canonical names shadowed by a
    tensor_names entry or living outside tensor_prefix. They hold garbage so
    that picking one up makes the comparison fail."""
    if c.prefix:
        # Some tensors again without the prefix, and one under a longer one.
        decoys = [n for n in canonical if r.random() < 0.5] or ["out_proj.weight"]
        stored["other.layer." + c.prefix + "out_proj.weight"] = (
            np.full_like(canonical["out_proj.weight"], 7.0), "F32")
    else:
        decoys = list(renames)  # canonical names redirected by tensor_names
    for name in decoys:
        stored.setdefault(name, (np.full_like(canonical[name], 3.0), "F32"))


def config_message(c, renames):
    """The mha.v1.ModelConfig of case c as a dict for format_pbtxt."""
    m = {"embed_dim": c.E, "num_heads": c.h}
    if c.kdim != c.E or c.explicit:
        m["kdim"] = c.kdim
    if c.vdim != c.E or c.explicit:
        m["vdim"] = c.vdim
    if c.dk:
        m["qk_head_dim"], m["v_head_dim"] = c.dk, c.dv
    if not c.bias or c.explicit:
        m["bias"] = c.bias
    if c.add_bias_kv:
        m["add_bias_kv"] = True
    if c.add_zero_attn:
        m["add_zero_attn"] = True
    if c.compute != "FP32" or c.explicit:
        m["compute_dtype"] = Enum("DATA_TYPE_" + c.compute)
    if c.norm_eps is not None:
        m["post_norm"] = {"eps": c.norm_eps} if c.write_eps else {}
    if c.prefix:
        m["tensor_prefix"] = c.prefix
    if renames:
        m["tensor_names"] = [{"key": k, "value": v}
                             for k, v in sorted(renames.items())]
    return m


# ----------------------------------------------------------------- inputs

def make_inputs(c, gen):
    """{name: torch tensor} for the inputs file (masks as bool or float32)."""
    lead = (c.batch,) if c.batch else ()
    inputs = {"query": torch.randn(*lead, c.L, c.E, generator=gen) * 0.5}
    if c.mode != "self":
        inputs["key"] = torch.randn(*lead, c.S, c.kdim, generator=gen) * 0.5
    if c.mode == "cross":
        inputs["value"] = torch.randn(*lead, c.S, c.vdim, generator=gen) * 0.5
    if c.kpm:
        inputs["key_padding_mask"] = _random_mask(c.kpm, (*lead, c.S), gen)
    if c.attn_mask:
        dims, kind = c.attn_mask.split("-")
        shape = (c.L, c.S) if dims == "2d" else (max(c.batch, 1) * c.h,
                                                 c.L, c.S)
        inputs["attn_mask"] = _random_mask(kind, shape, gen)
    if c.full_rows:
        _mask_full_rows(c, inputs)
    return inputs


def _random_mask(kind, shape, gen):
    """bool: ~30% True (masked). float: N(0, 1) with ~15% -inf entries."""
    u = torch.rand(*shape, generator=gen)
    if kind == "bool":
        return u < 0.3
    values = torch.randn(*shape, generator=gen)
    if shape[-1] == 1:  # a single key: keep it, _mask_full_rows covers -inf
        return values
    return values.masked_fill(u < 0.15, float("-inf"))


def _mask_full_rows(c, inputs):
    """Make some query rows see no key at all (before bias_kv/zero_attn)."""
    def masked(m):
        return True if m.dtype == torch.bool else float("-inf")

    kpm = inputs.get("key_padding_mask")
    am = inputs.get("attn_mask")
    if kpm is not None:
        seq = kpm if kpm.dim() == 1 else kpm[-1]  # last sequence of the batch
        if c.causal:
            seq[0] = masked(kpm)   # with causal masking, row 0 sees key 0 only
        elif c.batch >= 2 or am is None:
            # Padding out a whole sequence; not the only one unless needed.
            seq[:] = masked(kpm)
    if am is not None:
        row = c.L // 2
        if am.dim() == 2:
            am[row, :] = masked(am)
        else:
            am[0, row, :] = masked(am)  # one (batch, head) pair only


# ----------------------------------------------------------------- expected

def expected_outputs(c, ref_params, inputs):
    out, probs = reference_mha(
        ref_params, c.h, inputs["query"], inputs.get("key"),
        inputs.get("value"), inputs.get("key_padding_mask"),
        inputs.get("attn_mask"), c.causal, c.add_zero_attn, c.norm_eps)
    expected = {"output": out}
    if c.weights == "avg":
        expected["attn_weights"] = probs.mean(dim=-3)
    elif c.weights == "head":
        expected["attn_weights"] = probs
    return {k: v.numpy() for k, v in expected.items()}


# ----------------------------------------------------------------- run/compare

def run_mha(mha_run, c, case_dir):
    """Runs mha_run on the files of case_dir; returns an error string or None."""
    cmd = [mha_run, "--model", os.path.join(case_dir, "model"),
           "--inputs", os.path.join(case_dir, "inputs.safetensors"),
           "--outputs", os.path.join(case_dir, "outputs.safetensors")]
    if c.causal:
        cmd.append("--is_causal")
    if c.weights:
        cmd.append("--need_weights")
    if c.weights == "head":
        cmd.append("--per_head_weights")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"timed out after {RUN_TIMEOUT_S}s"
    except OSError as e:
        return f"cannot run {mha_run}: {e}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return f"exit code {proc.returncode}: {last}"
    return None


def compare(c, expected, actual, dtypes):
    """Returns (worst error, list of problems). `actual` maps output names to
    float32 arrays, `dtypes` to the dtypes they came in. The error is absolute
    for fp32 and relative to max |reference| for bf16."""
    worst, problems = 0.0, []
    relative = c.compute != "FP32"
    tol = {"BF16": BF16_REL_TOL, "INT8": INT8_REL_TOL}.get(c.compute,
                                                          FP32_ABS_TOL)
    for name, ref in expected.items():
        if name not in actual:
            worst, problems = math.inf, problems + [f"{name} missing"]
            continue
        got = actual[name]
        if dtypes[name] != "F32":
            problems.append(f"{name} dtype {dtypes[name]}, expected F32")
        if got.shape != ref.shape:
            problems.append(f"{name} shape {list(got.shape)}, "
                            f"expected {list(ref.shape)}")
            worst = math.inf
            continue
        err = _max_error(got, ref, relative=relative,
                         floor=1.0 if c.compute == "INT8" else 1e-30)
        worst = max(worst, err)
        if not err <= tol:
            problems.append(_describe_error(name, got, ref, err))
    return worst, problems


def _max_error(got, ref, relative, floor=1e-30):
    if got.size == 0:
        return 0.0
    diff = np.abs(got.astype(np.float64) - ref)
    err = math.inf if np.isnan(diff).any() else float(diff.max())
    if relative:
        err /= max(float(np.abs(ref).max()), floor)
    return err


def _describe_error(name, got, ref, err):
    diff = np.abs(got.astype(np.float64) - ref)
    diff[np.isnan(diff)] = np.inf
    at = np.unravel_index(np.argmax(diff), diff.shape)
    return (f"{name} error {err:.3g} at {list(map(int, at))}: "
            f"got {got[at]:.6g}, expected {ref[at]:.6g}")


def prepare_case(c, model_dir, inputs_path, seed):
    """Writes the model folder and the inputs file of case c; returns
    (inputs, expected outputs)."""
    gen = torch.Generator().manual_seed(seed * 100003 + c.id)
    r = random.Random(f"files:{seed}:{c.id}")
    params = make_params(c, gen)
    ref_params = write_model(c, params, model_dir, r)
    inputs = make_inputs(c, gen)
    write_safetensors(
        inputs_path,
        {k: (v.numpy(), "BOOL" if v.dtype == torch.bool else "F32")
         for k, v in inputs.items()})
    return inputs, expected_outputs(c, ref_params, inputs)


def run_case(c, mha_run, case_dir, seed):
    """Writes the files of case c, runs mha_run; returns (error, problems)."""
    _, expected = prepare_case(c, os.path.join(case_dir, "model"),
                               os.path.join(case_dir, "inputs.safetensors"),
                               seed)
    failure = run_mha(mha_run, c, case_dir)
    if failure:
        return math.inf, [failure]
    try:
        actual, dtypes = read_safetensors(
            os.path.join(case_dir, "outputs.safetensors"))
    except (OSError, ValueError, KeyError) as e:
        return math.inf, [f"cannot read outputs: {e}"]
    return compare(c, expected, actual, dtypes)


# ----------------------------------------------------------------- main

def parse_ids(spec, count):
    """"3,7-9" -> [3, 7, 8, 9]; None -> range(count)."""
    if not spec:
        return list(range(count))
    ids = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        ids += range(int(lo), int(hi or lo) + 1)
    return ids


def mha_run_results(args, ids, workdir, _notes):
    """(case, error, problems) for each case id, one mha_run per case."""
    for index in ids:
        c = make_case(index, args.seed)
        case_dir = os.path.join(workdir, f"case_{index:03d}")
        os.makedirs(case_dir, exist_ok=True)
        yield (c, *run_case(c, args.mha_run, case_dir, args.seed))


def server_results(args, ids, workdir, notes):
    """(case, error, problems) for each case id, all from one mha_server
    serving every case's model. Problems of the server itself (a crash, a
    failed shutdown) are appended to `notes`."""
    from parity_server import ParityServer, model_name
    repository = os.path.join(workdir, "repository")
    os.makedirs(os.path.join(workdir, "inputs"), exist_ok=True)
    cases = []
    for index in ids:
        c, name = make_case(index, args.seed), model_name(index)
        inputs, expected = prepare_case(
            c, os.path.join(repository, name),
            os.path.join(workdir, "inputs", name + ".safetensors"), args.seed)
        cases.append((c, name, inputs, expected))
    with ParityServer(args.server, repository, RUN_TIMEOUT_S) as server:
        for c, name, inputs, expected in cases:
            failure, actual, dtypes = server.attend(c, name, inputs)
            if failure:
                yield c, math.inf, [failure]
            else:
                yield (c, *compare(c, expected, actual, dtypes))
    notes += server.problems()


def run_all(args):
    workdir = args.workdir or tempfile.mkdtemp(prefix="mha_parity_")
    results = server_results if args.server else mha_run_results
    passed = failed = 0
    notes = []
    for c, err, problems in results(args, parse_ids(args.only, args.configs),
                                    workdir, notes):
        ok = not problems
        passed, failed = passed + ok, failed + (not ok)
        print(f"[{c.id:3d}] {describe(c):<72} max_err={err:.2e} "
              f"{'PASS' if ok else 'FAIL'}", flush=True)
        for problem in problems:
            print(f"      {problem}", flush=True)
    for note in notes:
        print(note, flush=True)
    if args.workdir or args.keep:
        print(f"files kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
        if failed:
            print("rerun with --keep --only ID to inspect a failing case")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and not notes else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mha_run", help="path of the mha_run executable")
    ap.add_argument("--server", metavar="MHA_SERVER",
                    help="path of the mha_server executable: run every case "
                    "through one server instead of mha_run")
    ap.add_argument("--configs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="where to write the case files "
                    "(kept); default: a temporary directory")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temporary directory")
    ap.add_argument("--only", help="run only these case ids, e.g. 3,7-9")
    ap.add_argument("--write-demo", metavar="DIR",
                    help="write the built-in demo model to DIR and exit")
    args = ap.parse_args()
    if args.write_demo:
        from make_demo_model import write_demo_model
        write_demo_model(args.write_demo)
        return 0
    if bool(args.mha_run) == bool(args.server):
        ap.error("exactly one of --mha_run and --server is required")
    torch.set_num_threads(1)  # the reference is tiny; leave cores to mha_run
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
