"""What ``gradbuilder train`` checks before a graph is built or a step runs: the options against
each other, the .npz arrays, the names the model and the data must have; and the evaluation
behind ``--accuracy``."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidArgumentError
from .common import check_input_file, listed, one_line


def check_train_options(args) -> None:
    """Options that contradict each other."""
    if args.loss is None:
        for option in ("loss_output", "target"):
            if getattr(args, option) is not None:
                raise InvalidArgumentError(f"--{option.replace('_', '-')} needs --loss")
    if args.keep and not args.output:
        raise InvalidArgumentError("--keep needs -o (the inference model it names the outputs of)")
    if args.eval_data and not args.accuracy:
        raise InvalidArgumentError("--eval-data needs --accuracy")
    for option in ("save_every", "max_restarts"):
        if getattr(args, option) is not None and not args.checkpoint:
            raise InvalidArgumentError(f"--{option.replace('_', '-')} needs --checkpoint PATH (the checkpoints are "
                                       "written beside it, and a restart resumes from them)")
    if args.resume == "auto" and not args.checkpoint:
        raise InvalidArgumentError("--resume auto needs --checkpoint PATH (it resumes from the newest checkpoint "
                                   "written beside it)")
    uses = {"warmup_steps": ("linear", "cosine", "constant_with_warmup"), "step_size": ("step",), "gamma": ("step",)}
    for option, schedules in uses.items():
        if getattr(args, option) is not None and args.scheduler not in schedules:
            raise InvalidArgumentError(f"--{option.replace('_', '-')} needs --scheduler {' or '.join(schedules)}")


def load_arrays(option: str, path: str, batch_size: int) -> dict:
    """The arrays of the ``.npz`` file ``path``: numeric, each with a batch axis, all of the
    same length, at least ``batch_size`` rows."""
    import zipfile

    import numpy as np

    check_input_file(option, path)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:  # pickled or not numpy's
        raise InvalidArgumentError(f"{option} {path}: not a numpy .npz file ({one_line(exc)})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InvalidArgumentError(f"{option} {path}: holds a single array (.npy); write one array per model "
                                   "input with numpy.savez(path, name=array, ...)")
    arrays = {}
    with loaded as npz:
        for name in npz.files:
            try:
                arrays[name] = npz[name]
            except (ValueError, OSError, zipfile.BadZipFile) as exc:
                raise InvalidArgumentError(f"{option} {path}: array '{name}' cannot be read: {one_line(exc)}") from None
    if not arrays:
        raise InvalidArgumentError(f"{option} {path}: holds no arrays")
    scalars = [name for name, a in arrays.items() if a.ndim == 0]
    if scalars:
        raise InvalidArgumentError(f"{option} {path}: {scalars} are scalars; every array needs a batch axis (axis 0)")
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise InvalidArgumentError(f"{option} {path}: the arrays differ in length along axis 0: {lengths}")
    rows = next(iter(lengths.values()))
    if rows < batch_size:
        raise InvalidArgumentError(f"{option} {path}: {rows} rows, fewer than --batch-size {batch_size}")
    return arrays


def _values(graph) -> set[str]:
    """Every value name of ``graph``: inputs, initializers, node outputs."""
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    return names | {o for n in graph.node for o in n.output if o}


def _inputs_needed(graph, outputs) -> list[str]:
    """The graph inputs (less initializers) that computing ``outputs`` reads, subgraphs included."""
    from ..compiler.traversal import proto_subgraphs

    producer = {o: n for n in graph.node for o in n.output if o}
    inputs = {i.name for i in graph.input} - {t.name for t in graph.initializer}

    def read_by(node):
        yield from (i for i in node.input if i)
        for g in proto_subgraphs(node):
            for inner in g.node:
                yield from read_by(inner)

    seen, todo = set(), list(outputs)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            if name in producer:
                todo.extend(read_by(producer[name]))
    return [i.name for i in graph.input if i.name in inputs and i.name in seen]


def check_model_names(args, model, loss_name: str, data: dict, evaluation: dict) -> list[str]:
    """The names the options give (--keep, --accuracy) are the model's, and the data holds an
    array for every input the model and --accuracy read: the inference model's outputs (--keep)."""
    values = _values(model.graph)
    outputs = [o.name for o in model.graph.output]
    keep = args.keep or [o for o in outputs if o != loss_name] or [loss_name]
    unknown = [k for k in keep if k not in values]
    if unknown:
        raise InvalidArgumentError(f"--keep: the model has no values named {listed(unknown)}; its outputs are "
                                   f"{listed(outputs)}")
    initializers = {t.name for t in model.graph.initializer}
    missing = [i.name for i in model.graph.input if i.name not in initializers and i.name not in data]
    if missing:
        raise InvalidArgumentError(f"--data {args.data}: no arrays for the model input(s) {listed(missing)}; "
                                   f"it has {listed(sorted(data))}")
    if args.accuracy:
        scores_name, target = args.accuracy
        where = f"--eval-data {args.eval_data}" if args.eval_data else f"--data {args.data}"
        if scores_name not in values:
            raise InvalidArgumentError(f"--accuracy {scores_name}:{target}: the model has no value '{scores_name}'; "
                                       f"its outputs are {listed(outputs)}")
        wanted = [target] + _inputs_needed(model.graph, [scores_name])
        missing = [n for n in wanted if n not in evaluation]
        if missing:
            raise InvalidArgumentError(f"--accuracy {scores_name}:{target}: {where} has no array "
                                       f"{listed(repr(m) for m in missing)}; it has {listed(sorted(evaluation))}")
    return keep


def evaluate(session, output: str, data, batch_size: int):
    """``output`` of the model with the trained weights over ``data``, in whole batches."""
    import tempfile

    import numpy as np
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "trained.onnx")
        session.export_model_for_inferencing(path, [output])
        infer = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [i.name for i in infer.get_inputs()]
        n = len(next(iter(data.values()))) // batch_size * batch_size  # the arrays share their length
        parts = [infer.run([output], {k: data[k][i: i + batch_size] for k in names})[0]
                 for i in range(0, n, batch_size)]
    return np.concatenate(parts)
