"""Gradient coverage over ONNX's own backend node test cases.

Every case of ``onnx.backend.test.case.node.collect_testcases()`` with a float input and a
float output is differentiated: loss = a fixed random projection of every float output,
gradients for every float input, compared with float64 finite differences
(``gradbuilder.testing.gradcheck``) at the case's own input data. Writes
``docs/op-coverage.md``: per op type the cases passed/total and, where cases do not pass,
why (no rule, not differentiable by definition, a mismatch, an error).

    python tools/op_coverage.py              # run, print the summary, write docs/op-coverage.md
    python tools/op_coverage.py --check      # fail (exit 1) if fewer cases pass than the doc records
    python tools/op_coverage.py --only Relu Conv
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np

DOC = Path(__file__).resolve().parent.parent / "docs" / "op-coverage.md"
FLOATS = {1, 10, 11, 16}  # float, float16, double, bfloat16

# Ops whose outputs have no derivative by definition (random draws, quantization steps);
# their cases are listed but not counted in the denominator.
NOT_DIFFERENTIABLE = {
    "Bernoulli": "random draw",
    "RandomNormal": "random draw",
    "RandomNormalLike": "random draw",
    "RandomUniform": "random draw",
    "RandomUniformLike": "random draw",
    "Multinomial": "random draw",
    "DynamicQuantizeLinear": "quantization step function",
    "QuantizeLinear": "quantization step function",
}


def _cases(only=None):
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    out = []
    for case in cases:
        if case.model is None or not case.data_sets:
            continue
        graph = case.model.graph
        if not any(i.type.tensor_type.elem_type in FLOATS for i in graph.input):
            continue
        if not any(o.type.tensor_type.elem_type in FLOATS for o in graph.output):
            continue
        op = graph.node[0].op_type if len(graph.node) == 1 else _main_op(case)
        if only and op not in only:
            continue
        out.append((op, case))
    return out


def _main_op(case) -> str:
    """The op a multi-node case tests: ``test_<op>_...`` (``_expanded`` cases expand the op's
    function), else the most frequent op of the graph."""
    import onnx

    name = case.name.lower().removeprefix("test_").replace("_", "")
    ops = sorted({s.name for s in onnx.defs.get_all_schemas()}, key=len, reverse=True)
    for op in ops:
        if name.startswith(op.lower()):
            return op
    counts = collections.Counter(n.op_type for n in case.model.graph.node)
    return counts.most_common(1)[0][0]


def with_loss(model, outputs: dict[str, np.ndarray], seed: int = 0):
    """``model`` plus a scalar output ``gb_loss`` = sum_k sum(out_k * R_k) over float outputs."""
    import onnx
    from onnx import helper, numpy_helper

    from gradbuilder.compiler.modelio import add_default_opset

    rng = np.random.default_rng(seed)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    add_default_opset(m)
    g = m.graph
    terms = []
    for out in list(g.output):
        if out.type.tensor_type.elem_type not in FLOATS or out.name not in outputs:
            continue
        value = np.asarray(outputs[out.name])
        pname = f"gb_proj_{len(terms)}"
        g.initializer.append(numpy_helper.from_array(rng.standard_normal(value.shape), pname))
        if m.ir_version < 4:  # initializers were graph inputs too
            g.input.append(helper.make_tensor_value_info(pname, onnx.TensorProto.DOUBLE, value.shape))
        g.node.append(helper.make_node("Cast", [out.name], [f"{pname}_x"], to=onnx.TensorProto.DOUBLE))
        g.node.append(helper.make_node("Mul", [f"{pname}_x", pname], [f"{pname}_m"]))
        cast = f"{pname}_s"
        g.node.append(helper.make_node("ReduceSum", [f"{pname}_m"], [cast], keepdims=0))
        terms.append(cast)
    g.node.append(helper.make_node("Sum", terms, ["gb_loss"]))
    g.output.append(helper.make_tensor_value_info("gb_loss", onnx.TensorProto.DOUBLE, []))
    return m


def _array(v):
    import onnx
    from onnx import numpy_helper

    return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v


def nondifferentiable_at(model, weights, loss, feeds, h=1e-6, max_elements=48, seed=0, seconds=60.0) -> str:
    """Why ``loss`` has no derivative at ``feeds`` ("" when it may have one): along some
    element of a weight the one-sided difference quotients are each steady (the same at
    steps h, 3h/4, h/2, h/4) but disagree (a kink, a tie), or they grow as the step shrinks (a jump:
    a rounding boundary), or a step changes an output's shape or makes it non-finite.
    Quotients that are not steady on either side are noise, not evidence. Gives up ("")
    after ``seconds``."""
    from gradbuilder.testing import forward_model, reference_evaluator, to_float64

    proto = to_float64(model)
    run = reference_evaluator(forward_model(proto, weights, loss)).run
    base = {k: (np.asarray(v).astype(np.float64) if _is_float(v) else v) for k, v in feeds.items()}

    def f(name, value):
        out = np.asarray(run(None, {**base, name: value})[0], dtype=np.float64).reshape(-1)
        return float(out[0]) if out.size == 1 else float("nan")

    rng = np.random.default_rng(seed)
    started = time.monotonic()
    for w in weights:
        x = base[w]
        flat = x.reshape(-1)
        idx = range(flat.size) if flat.size <= max_elements else rng.choice(flat.size, max_elements, replace=False)
        f0 = f(w, x)
        for i in idx:
            if time.monotonic() - started > seconds:
                return ""
            quotients = {}
            for side in (1.0, -1.0):
                for frac in (1.0, 0.75, 0.5, 0.25):
                    moved = flat.copy()
                    moved[i] += side * frac * h
                    try:
                        value = f(w, moved.reshape(x.shape))
                    except Exception:  # noqa: BLE001 - a step that breaks the op is a discontinuity
                        return f"{w}[{i}]: a step of {side * frac * h:g} changes the output's shape"
                    quotients.setdefault(side, []).append((value - f0) / (side * frac * h))
            right, left = quotients[1.0], quotients[-1.0]
            if not np.all(np.isfinite(right + left)):
                return f"{w}[{i}]: non-finite one-sided derivative"
            big = 1e2 * (1.0 + abs(f0))
            for q in (right, left):
                if abs(q[-1]) > 3 * abs(q[0]) > big:
                    return f"{w}[{i}]: a jump (the difference quotient grows as the step shrinks: {q[0]:.3g}, {q[-1]:.3g})"
            steady = all(_close(q[0], v) for q in (right, left) for v in q[1:])
            if steady and not _close(right[0], left[0]):
                return f"{w}[{i}]: one-sided derivatives differ ({left[0]:.3g} vs {right[0]:.3g})"
    return ""


def _is_float(v) -> bool:
    dtype = np.asarray(v).dtype
    return dtype.kind == "f" or dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _safe_kink_check(model, weights, feeds) -> str:
    """nondifferentiable_at for a case whose check raised: "" when the forward cannot even
    run at the case's own data."""
    try:
        return nondifferentiable_at(model, weights, "gb_loss", feeds)
    except Exception:  # noqa: BLE001
        return ""


def _close(a: float, b: float, tol: float = 1e-2) -> bool:
    return abs(a - b) <= tol * (1.0 + abs(a) + abs(b))


def check_case(item) -> tuple[str, str, str, str]:
    """(op, case name, status, detail): status pass / mismatch / norule / notdiff / undefined / error."""
    op, case = item
    from gradbuilder import UnsupportedOpError
    from gradbuilder.testing import gradcheck

    if op in NOT_DIFFERENTIABLE:
        return op, case.name, "notdiff", NOT_DIFFERENTIABLE[op]
    graph = case.model.graph
    inits = {t.name for t in graph.initializer}
    input_names = [i.name for i in graph.input if i.name not in inits]
    inputs, expected = case.data_sets[0]
    inputs = [_array(v) for v in inputs]
    expected = [_array(v) for v in expected]
    feeds = dict(zip(input_names, inputs))
    outs = dict(zip([o.name for o in graph.output], expected))
    if any(np.asarray(v).dtype.kind == "f" and not np.all(np.isfinite(np.asarray(v, dtype=np.float64)))
           for v in list(outs.values()) + list(feeds.values())):
        return op, case.name, "undefined", "non-finite values at the test point"
    weights = [i.name for i in graph.input if i.type.tensor_type.elem_type in FLOATS and i.name in feeds]
    model = with_loss(case.model, outs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = gradcheck(model, weights, "gb_loss", feeds, max_elements=6, directions=2,
                               rtol=1e-3, atol=1e-5, eps=1e-6)
    except UnsupportedOpError as exc:
        m = re.search(r"op_type=(\w+)", str(exc))
        return op, case.name, "norule", f"no rule for {m.group(1) if m else op}"
    except Exception as exc:  # noqa: BLE001 - every failure is recorded with its message
        kink = _safe_kink_check(model, weights, feeds)
        if kink:
            return op, case.name, "undefined", kink
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return op, case.name, "error", f"{type(exc).__name__}: {first[:160]}"
    if report.passed:
        return op, case.name, "pass", ""
    kink = nondifferentiable_at(model, weights, "gb_loss", feeds)
    if kink:
        return op, case.name, "undefined", kink
    worst = max(report.weights, key=lambda w: w.max_abs_err)
    return op, case.name, "mismatch", f"{worst.name}: max abs err {worst.max_abs_err:.2g}"


def _indexed_check(pair):
    k, item = pair
    return k, check_case(item)


def run(only=None, jobs: int = 1):
    from tqdm import tqdm  # a progress bar on a terminal (stderr), nothing in logs and pipes

    items = _cases(only)
    with tqdm(total=len(items), desc="op coverage", unit=" cases", disable=None) as bar:
        if jobs > 1:
            with multiprocessing.get_context("spawn").Pool(jobs) as pool:
                done = []
                for kr in pool.imap_unordered(_indexed_check, list(enumerate(items))):  # one case at a time
                    done.append(kr)
                    bar.update(1)
                return [r for _, r in sorted(done, key=lambda kr: kr[0])]
        results = []
        for i in items:
            results.append(check_case(i))
            bar.update(1)
        return results


def summarize(results):
    counted = [r for r in results if r[2] not in ("notdiff", "undefined")]
    passed = sum(r[2] == "pass" for r in counted)
    return passed, len(counted)


KINK = "no derivative at the case's data"


def _category(result) -> str:
    return KINK if result[2] == "undefined" and "[" in result[3] else result[3]


def write_doc(results, path: Path = DOC) -> None:
    import onnx

    passed, total = summarize(results)
    by_op: dict[str, list] = collections.defaultdict(list)
    for r in results:
        by_op[r[0]].append(r)
    lines = [
        "# Gradient coverage over ONNX's backend node tests",
        "",
        f"Generated by `python tools/op_coverage.py` with onnx {onnx.__version__}. Every backend node test",
        "case with a float input and a float output: loss = a fixed random projection of every float",
        "output, gradients for every float input, compared with float64 finite differences at the",
        "case's own data. Not counted: cases of ops with no derivative by definition, cases whose data",
        "hold non-finite values, and cases whose data sit where the loss has no derivative (one-sided",
        "finite differences disagree, or a small step changes an output's shape); the last section",
        "lists those with the evidence.",
        "",
        f"COVERAGE: {passed}/{total} differentiable cases pass ({100.0 * passed / max(total, 1):.1f}%)",
        "",
        "| op | passed / counted | not counted | what fails |",
        "|---|---|---|---|",
    ]
    for op in sorted(by_op):
        rs = by_op[op]
        counted = [r for r in rs if r[2] not in ("notdiff", "undefined")]
        ok = sum(r[2] == "pass" for r in counted)
        skipped = [r for r in rs if r[2] in ("notdiff", "undefined")]
        reasons = collections.Counter(r[3] for r in counted if r[2] != "pass")
        why = "; ".join(f"{k} ({v})" if v > 1 else k for k, v in reasons.most_common(3))
        not_counted = "; ".join(sorted({_category(r) for r in skipped})) if skipped else ""
        lines.append(f"| {op} | {ok} / {len(counted)} | {len(skipped) or ''} {('(' + not_counted + ')') if skipped else ''} | {why} |")
    kinks = [r for r in results if r[2] == "undefined" and _category(r) == KINK]
    if kinks:
        lines += ["", "## Cases at points without a derivative", ""]
        lines += [f"- {r[0]} `{r[1]}`: {r[3]}" for r in sorted(kinks)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def recorded(path: Path = DOC) -> tuple[int, int] | None:
    if not path.exists():
        return None
    m = re.search(r"COVERAGE: (\d+)/(\d+)", path.read_text())
    return (int(m.group(1)), int(m.group(2))) if m else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare with docs/op-coverage.md instead of writing it")
    ap.add_argument("--only", nargs="+", help="op types to run")
    ap.add_argument("--jobs", type=int, default=max(1, multiprocessing.cpu_count()))
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    results = run(args.only, args.jobs)
    passed, total = summarize(results)
    if args.verbose:
        for r in results:
            if r[2] != "pass":
                print(f"{r[2]:9s} {r[0]:28s} {r[1]}: {r[3]}")
    print(f"{passed}/{total} differentiable cases pass ({100.0 * passed / max(total, 1):.1f}%)")
    if args.check:
        rec = recorded()
        if rec is None:
            print("no recorded coverage in docs/op-coverage.md")
            return 1
        if passed < rec[0]:
            print(f"coverage dropped: {passed} < recorded {rec[0]}")
            return 1
        return 0
    if not args.only:
        write_doc(results)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
