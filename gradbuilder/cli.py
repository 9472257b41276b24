"""The `gradbuilder` command: build, artifacts, ops, demo, train.

Exit status: 0 done; 1 a failure while working (onnxruntime failed, a file could not be
written, the model's graph could not be differentiated or trained); 2 a usage error, as
argparse gives (an option that is bad or contradicts another, a file named on the command
line that is missing or unreadable, a name the model or the data does not have); 130 or 143
when `train` is stopped by SIGINT (Ctrl-C) or SIGTERM. Every error is one line on stderr,
``gradbuilder: error: ...``; whatever can be checked before the work starts is checked first,
and nothing is written by a command that fails.

At start this module imports the standard library only: ``--help`` and ``--version`` answer
without loading onnx, onnxruntime or numpy; each command imports what it needs.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import warnings
from pathlib import Path

from . import __version__
from .errors import CheckpointError, GradBuilderError, InvalidArgumentError, ModelLoadError

log = logging.getLogger(__name__)


def _optimizer_help() -> str:
    from .training.stages.optimizer import OPTIMIZERS

    *names, last = OPTIMIZERS
    return f"{', '.join(names)} or {last} (default adamw)"


# The errors that are the caller's: a name or option that does not fit, an input file that
# cannot be read. Every other GradBuilderError is a failure while working.
USAGE_ERRORS = (InvalidArgumentError, ModelLoadError)


def exit_status(exc: BaseException) -> int:
    """2 for a usage error, 1 for any other failure."""
    return 2 if isinstance(exc, USAGE_ERRORS) else 1


# ------------------------------------------------------------------ checks of the command line


def _check_input_file(option: str, path: str) -> None:
    from .files import check_input_file

    check_input_file(path, InvalidArgumentError, option)


def _check_output_file(option: str, path: str | None) -> None:
    """``path`` can be written: its directory exists and accepts files, and it is not itself a
    directory (gradbuilder.files says why not in one line)."""
    from .files import check_output_path

    if path is not None:
        check_output_path(path, InvalidArgumentError, option)


def _check_output_directory(option: str, path: str) -> None:
    """``path`` is a directory that accepts files, or can be made one."""
    from .files import check_output_directory

    check_output_directory(path, InvalidArgumentError, option)


def _check_distinct(**paths: str | None) -> None:
    given = {option: Path(p).resolve() for option, p in paths.items() if p is not None}
    options = list(given)
    for i, a in enumerate(options):
        for b in options[i + 1:]:
            if given[a] == given[b]:
                raise InvalidArgumentError(f"{a} and {b} name the same file {paths[a]}; give two paths")


def _load_arrays(option: str, path: str, batch_size: int) -> dict:
    """The arrays of the ``.npz`` file ``path``: numeric, each with a batch axis, all of the
    same length, at least ``batch_size`` rows."""
    import zipfile

    import numpy as np

    _check_input_file(option, path)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:  # pickled or not numpy's
        raise InvalidArgumentError(f"{option} {path}: not a numpy .npz file ({_one_line(exc)})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InvalidArgumentError(f"{option} {path}: holds a single array (.npy); write one array per model "
                                   "input with numpy.savez(path, name=array, ...)")
    arrays = {}
    with loaded as npz:
        for name in npz.files:
            try:
                arrays[name] = npz[name]
            except (ValueError, OSError, zipfile.BadZipFile) as exc:
                raise InvalidArgumentError(f"{option} {path}: array '{name}' cannot be read: {_one_line(exc)}") from None
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
    from onnx import AttributeProto

    producer = {o: n for n in graph.node for o in n.output if o}
    inputs = {i.name for i in graph.input} - {t.name for t in graph.initializer}

    def read_by(node):
        yield from (i for i in node.input if i)
        for a in node.attribute:
            subgraphs = [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)
            for g in subgraphs:
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


def _listed(names, most: int = 12) -> str:
    names = list(names)
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


# ------------------------------------------------------------------ commands


def _cmd_build(args) -> int:
    _check_input_file("model", args.model)
    _check_output_file("-o", args.output)
    from .compiler.builder import GradientGraphBuilder, default_weights

    weights = args.weights or default_weights(args.model)
    outputs = args.outputs or [args.loss]
    b = GradientGraphBuilder(args.model, weights=weights, outputs=outputs, loss=args.loss).build()
    b.save(args.output)
    t = b.timings
    print(f"wrote {args.output}: {len(weights)} weight gradients "
          f"(load {t['load']:.2f}s, differentiate {t['differentiate']:.2f}s, serialize {t['serialize']:.2f}s)")
    return 0


def _cmd_artifacts(args) -> int:
    _check_input_file("model", args.model)
    _check_output_directory("-o", args.output)
    if args.loss is None and (args.loss_output or args.target):
        raise InvalidArgumentError(f"{'--loss-output' if args.loss_output else '--target'} needs --loss")
    if args.weights or args.frozen:
        from .compiler import modelio
        from .compiler.builder import float_values

        _check_weights(args, float_values(modelio.load_proto(args.model, external=False)))
    from .training.artifacts import generate_artifacts

    written = generate_artifacts(args.model, requires_grad=args.weights, frozen_params=args.frozen or (),
                                 loss=args.loss, optimizer=args.optimizer, artifact_directory=args.output,
                                 loss_output=args.loss_output, target_name=args.target or "target")
    for path in written.values():
        print(f"wrote {path}")
    return 0


def _check_weights(args, floats) -> None:
    for option, names in (("--weights", args.weights), ("--frozen", args.frozen)):
        unknown = [n for n in names or () if n not in floats]
        if unknown:
            raise InvalidArgumentError(f"{option}: the model has no float initializer named {_listed(unknown)} "
                                       "(nor a float Constant output of that name); its float initializers and "
                                       f"Constant outputs are {_listed(floats)}")


def _cmd_ops(args) -> int:
    from .compiler import registry

    rules = registry.all_rules()
    print(f"{len(rules)} gradient rules")
    print(f"{'domain':16s} {'op_type':34s} since opset")
    for r in rules:
        print(f"{r.domain or 'ai.onnx':16s} {r.op_type:34s} {r.since}")
    return 0


def _cmd_demo(args) -> int:
    _check_output_file("--output", args.output)
    from .demo import run

    return 0 if run(steps=args.steps, output=args.output, progress=_progress(args)) else 1


def _progress(args) -> bool | None:
    """--progress / --no-progress; -q turns the bar off unless --progress is given; by
    default the bar shows on a terminal only."""
    if args.progress is not None:
        return args.progress
    return False if args.quiet else None


class _Stop:
    """SIGINT and SIGTERM while training, remembered and acted on between steps: a step in
    progress (an onnxruntime run, the state it updates) always finishes."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "_Stop":
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            self._previous = {s: signal.signal(s, self._received) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _received(self, signum, frame) -> None:
        self.signum = signum

    def __call__(self) -> bool:
        return self.signum is not None


def _cmd_train(args) -> int:
    # Everything the command line decides is checked before a graph is built or a step runs.
    _check_train_options(args)
    _check_input_file("model", args.model)
    if args.resume:
        _check_input_file("--resume", args.resume)
    _check_output_file("--checkpoint", args.checkpoint)
    _check_output_file("-o", args.output)
    _check_distinct(**{"--checkpoint": args.checkpoint, "-o": args.output})
    data = _load_arrays("--data", args.data, args.batch_size)
    evaluation = _load_arrays("--eval-data", args.eval_data, args.batch_size) if args.eval_data else data
    from .runtime.distributed import launched

    group = launched()
    world = group[1] if group is not None else args.nproc_per_node
    if args.batch_size % world:
        raise InvalidArgumentError(f"--batch-size {args.batch_size} must be divisible by the {world} processes "
                                   "(each takes an equal share of every batch)")
    if args.zero_stage and world == 1:
        raise InvalidArgumentError("--zero-stage needs --nproc-per-node N > 1 (it partitions state across processes)")
    if world > 1 and group is None:
        return _launch(args)
    main_rank = group is None or group[0] == 0  # the one that reports and writes files
    if not main_rank:
        logging.getLogger("gradbuilder").setLevel(logging.WARNING)

    from . import TrainingParameters
    from .compiler import modelio
    from .compiler.builder import default_weights, float_values
    from .runtime.loop import BATCHES_SEEN, accuracy, fit

    model, large = modelio.load_detached(args.model)  # large tensors apart: a model over 2 GB trains too
    loss_name = args.loss_name
    if args.loss:
        from .training.loss import append_loss

        output = args.loss_output or model.graph.output[0].name
        loss_name = loss_name or "loss"
        model = append_loss(model, args.loss, output, target_name=args.target or "target", loss_name=loss_name)
    loss_name = loss_name or model.graph.output[0].name
    _check_weights(args, float_values(model))
    values = _values(model.graph)
    outputs = [o.name for o in model.graph.output]
    keep = args.keep or [o for o in outputs if o != loss_name] or [loss_name]
    unknown = [k for k in keep if k not in values]
    if unknown:
        raise InvalidArgumentError(f"--keep: the model has no values named {_listed(unknown)}; its outputs are "
                                   f"{_listed(outputs)}")
    initializers = {t.name for t in model.graph.initializer}
    missing = [i.name for i in model.graph.input if i.name not in initializers and i.name not in data]
    if missing:
        raise InvalidArgumentError(f"--data {args.data}: no arrays for the model input(s) {_listed(missing)}; "
                                   f"it has {_listed(sorted(data))}")
    if args.accuracy:
        scores_name, target = args.accuracy
        where = f"--eval-data {args.eval_data}" if args.eval_data else f"--data {args.data}"
        if scores_name not in values:
            raise InvalidArgumentError(f"--accuracy {scores_name}:{target}: the model has no value '{scores_name}'; "
                                       f"its outputs are {_listed(outputs)}")
        wanted = [target] + _inputs_needed(model.graph, [scores_name])
        missing = [n for n in wanted if n not in evaluation]
        if missing:
            raise InvalidArgumentError(f"--accuracy {scores_name}:{target}: {where} has no array "
                                       f"{_listed(repr(m) for m in missing)}; it has {_listed(sorted(evaluation))}")

    params = TrainingParameters(loss_output_name=loss_name, training_optimizer_name=args.optimizer,
                                enable_grad_norm_clip=args.max_grad_norm is not None,
                                gradient_accumulation_steps=args.accumulation_steps,
                                deepspeed_zero_stage=args.zero_stage)
    if args.weights:
        params.weights_to_train = args.weights
    if args.frozen:
        params.weights_not_to_train = args.frozen
    if args.max_grad_norm is not None:
        weights = args.weights or [w for w in default_weights(model) if w not in (args.frozen or [])]
        params.optimizer_attributes_map = {w: {"max_norm_clip": args.max_grad_norm} for w in weights}
    providers = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
                 "auto": None}[args.device]
    from .runtime.session import TrainingSession

    session = TrainingSession(modelio.DetachedModel(model, large), params, providers=providers)
    del large
    done = 0
    if args.resume:
        try:
            session.load_checkpoint(args.resume)
        except CheckpointError as exc:  # a file named on the command line that does not fit
            raise InvalidArgumentError(f"--resume {args.resume}: {_one_line(exc)}") from None
        done = int(session.properties.get(BATCHES_SEEN, session.step * args.accumulation_steps))
        log.info("resumed from %s at step %d (%d batches), learning rate %g", args.resume, session.step, done,
                 session.get_learning_rate())
        ignored = [f"--{k.replace('_', '-')}" for k in _RESUMED if getattr(args, k) is not None]
        if ignored:
            warnings.warn(f"{' '.join(ignored)} are ignored with --resume: the checkpoint's learning rate, schedule "
                          "and data order continue", UserWarning, stacklevel=1)
    else:
        session.set_learning_rate(args.lr if args.lr is not None else 1e-3)
        if args.scheduler:
            session.register_scheduler(args.scheduler, **_scheduler_args(args))

    losses: list[float] = []
    with _Stop() as stop:
        log.info("training %s on %s: %d weights (%s values), %s, lr %g, batch %d", args.model,
                 session.get_providers()[0], len(session.weights), f"{session.get_parameters_size():,}",
                 args.optimizer, session.get_learning_rate(), args.batch_size)
        if done >= args.steps:
            log.info("nothing to train: the checkpoint has seen %d batches and --steps is %d", done, args.steps)
        else:
            losses = fit(session, data, args.steps - done, args.batch_size,
                         seed=args.seed if args.seed is not None else 0,
                         progress=_progress(args) if main_rank else False, stop=stop)
        if stop.signum is not None:  # handlers stay in place while the checkpoint is written
            return _stopped(args, session, stop.signum, int(session.properties.get(BATCHES_SEEN, done)))
    if args.checkpoint:  # every rank takes part; the first writes it
        session.save_checkpoint(args.checkpoint)
    if not main_rank:
        return 0
    if losses:
        shard = " (rank 0's share of each batch)" if world > 1 else ""
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {done + len(losses)} steps{shard}")
    score = None
    if args.accuracy:  # before the model is written: a failure here leaves no file behind
        scores_name, target = args.accuracy
        scores = _evaluate(session, scores_name, evaluation, args.batch_size)
        score = accuracy(scores, evaluation[target][: len(scores)])
    if args.checkpoint:
        print(f"wrote checkpoint {args.checkpoint}")
    if args.output:
        try:
            session.export_model_for_inferencing(args.output, keep)
        except BaseException:
            if args.checkpoint:  # the trained state is kept: resuming from it loses nothing
                log.warning("the checkpoint %s was written; -o %s was not", args.checkpoint, args.output)
            raise
        print(f"wrote {args.output} (outputs {', '.join(keep)})")
    if score is not None:
        print(f"accuracy ({args.accuracy[0]} vs {args.accuracy[1]}): {score:.1%}")
    return 0


def _launch(args) -> int:
    """This command again in ``--nproc-per-node`` processes, started by torch's launcher."""
    try:
        from torch.distributed import run
    except ImportError:
        raise InvalidArgumentError("--nproc-per-node needs torch.distributed: pip install 'gradbuilder[distributed]'") \
            from None
    rest, skip = [], False
    for arg in args.argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            rest.append(arg)
    log.info("starting %d processes with torch.distributed.run", args.nproc_per_node)
    try:
        run.main(["--nproc-per-node", str(args.nproc_per_node), "--standalone", "-m", "gradbuilder.cli", *rest])
    except Exception as exc:  # noqa: BLE001 - torch's ChildFailedError names the failed rank
        print(f"gradbuilder: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


def _cmd_export_web(args) -> int:
    _check_input_file("model", args.model)
    if args.loss is None and (args.loss_output or args.target):
        raise InvalidArgumentError("--loss-output and --target need --loss")
    from .training.web import export_web

    written = export_web(args.model, args.output, loss=args.loss, loss_output=args.loss_output,
                         target_name=args.target or "target", optimizer=args.optimizer, lr=args.lr,
                         requires_grad=args.weights, frozen_params=args.frozen or (),
                         max_grad_norm=args.max_grad_norm)
    print(f"wrote {len(written)} files to {args.output}: {', '.join(Path(p).name for p in written.values())}")
    print(f"train them with: node examples/train.mjs {args.output}  (gradbuilder-train.mjs: {_web_module()})")
    return 0


def _web_module() -> str:
    from .webdemo import WEB

    return str(WEB / "gradbuilder-train.mjs")


def _cmd_web_demo(args) -> int:
    import tempfile

    from . import webdemo

    if not args.output and not args.serve:
        raise InvalidArgumentError("web-demo: give -o DIR (the folder to write), --serve, or both")
    directory = webdemo.write(args.output or tempfile.mkdtemp(prefix="gradbuilder-web-demo-"), args.ort_web)
    print(f"wrote the demo to {directory}")
    if args.serve:
        try:
            webdemo.serve(directory, args.port)
        except KeyboardInterrupt:
            pass
    return 0


def _stopped(args, session, signum: int, seen: int) -> int:
    """Training stopped by ``signum`` after ``seen`` batches: save the checkpoint if asked."""
    name = signal.Signals(signum).name
    if args.checkpoint:
        session.save_checkpoint(args.checkpoint)
        print(f"gradbuilder: {name} after {seen} of {args.steps} batches: saved the training state to "
              f"{args.checkpoint}; to continue, run the same command with --resume {args.checkpoint}", file=sys.stderr)
    else:
        print(f"gradbuilder: {name} after {seen} of {args.steps} batches: nothing was saved (with --checkpoint PATH "
              "the state is saved there when training is stopped)", file=sys.stderr)
    return 128 + signum


def _check_train_options(args) -> None:
    """Options that contradict each other."""
    if args.loss is None:
        for option in ("loss_output", "target"):
            if getattr(args, option) is not None:
                raise InvalidArgumentError(f"--{option.replace('_', '-')} needs --loss")
    if args.keep and not args.output:
        raise InvalidArgumentError("--keep needs -o (the inference model it names the outputs of)")
    if args.eval_data and not args.accuracy:
        raise InvalidArgumentError("--eval-data needs --accuracy")
    uses = {"warmup_steps": ("linear", "cosine", "constant_with_warmup"), "step_size": ("step",), "gamma": ("step",)}
    for option, schedules in uses.items():
        if getattr(args, option) is not None and args.scheduler not in schedules:
            raise InvalidArgumentError(f"--{option.replace('_', '-')} needs --scheduler {' or '.join(schedules)}")


# what a checkpoint decides when training resumes from it
_RESUMED = ("lr", "scheduler", "warmup_steps", "step_size", "gamma", "seed")


def _scheduler_args(args) -> dict:
    """The schedule's options; it steps once per update (``--accumulation-steps`` batches)."""
    if args.scheduler == "step":
        return {"step_size": args.step_size or 100, "gamma": args.gamma if args.gamma is not None else 0.1}
    kwargs = {"warmup_steps": args.warmup_steps or 0}
    if args.scheduler in ("linear", "cosine"):
        kwargs["total_steps"] = max(1, args.steps // args.accumulation_steps)
    return kwargs


def _evaluate(session, output: str, data, batch_size: int):
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


# ------------------------------------------------------------------ the parser


def _integer(least: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: '{text}'") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _output_and_target(text: str) -> tuple[str, str]:
    scores, colon, target = text.partition(":")
    if not colon or not scores or not target:
        raise argparse.ArgumentTypeError(f"'{text}' is not OUTPUT:TARGET (e.g. logits:labels)")
    return scores, target


class _UsageError(Exception):
    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors raised (``main`` prints them on one line and returns 2)."""

    def error(self, message: str):
        raise _UsageError(self.prog, message)


def _common(p: argparse.ArgumentParser, progress: bool = False, top: bool = False) -> None:
    # given after the command they reach the same place as before it; after it they override
    default = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("-v", "--verbose", action="count", help="more notices (debug)", **({"default": 0} if top else default))
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only, no progress bar",
                   **default)
    if progress:
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show the progress bar (default: only when stderr is a terminal)")


def _artifact_arguments(p) -> None:
    """What ``artifacts`` and ``export-web`` share: the model, its loss, the optimizer, the
    weights and the output directory."""
    p.add_argument("model", help="path of the forward ONNX model")
    p.add_argument("--loss", help="append a loss: crossentropy, nll, mse, l1, bcewithlogits "
                                  "(default: the model's first output is the loss)")
    p.add_argument("--loss-output", help="with --loss: the output it reads (default: the first output)")
    p.add_argument("--target", help="with --loss: name of its target input (default target)")
    p.add_argument("--optimizer", default="adamw", help=_optimizer_help())
    p.add_argument("--weights", nargs="+", metavar="N", help=_WEIGHTS_HELP)
    p.add_argument("--frozen", nargs="+", metavar="N", help="weights not to train")
    p.add_argument("-o", "--output", required=True, help="directory to write the artifacts into (made if missing)")
    _common(p)


_WEIGHTS_HELP = ("weights to train: float initializers or Constant outputs (default: every float initializer; a model "
                 "without any, as paddle2onnx and spox write them: its float Constant tensors)")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="gradbuilder", description="Gradient graphs for ONNX models, trained on stock onnxruntime.",
                  epilog="Exit status: 0 done, 1 a failure while working, 2 a usage error, 130/143 training "
                         "stopped by SIGINT/SIGTERM.")
    top.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _common(top, top=True)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("build", help="write the model with its gradient graph")
    p.add_argument("model", help="path of the forward ONNX model")
    p.add_argument("--loss", required=True, help="name of the scalar loss value")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--weights", nargs="+", metavar="N", help="values to differentiate")
    which.add_argument("--all-initializers", action="store_true",
                       help="differentiate every float initializer (the default without --weights; a model without "
                            "any: its float Constant tensors)")
    p.add_argument("--outputs", nargs="+", metavar="N", help="values kept as outputs (default: the loss)")
    p.add_argument("-o", "--output", required=True, help="path of the model to write")
    _common(p)
    p.set_defaults(fn=_cmd_build)

    p = sub.add_parser("artifacts", help="write training, eval and optimizer models and a checkpoint")
    _artifact_arguments(p)
    p.set_defaults(fn=_cmd_artifacts)

    p = sub.add_parser("export-web", help="write what a JavaScript program needs to train the model with "
                                          "onnxruntime-web or onnxruntime-node")
    _artifact_arguments(p)
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="the learning rate the manifest starts with "
                                                                    "(default 1e-3)")
    p.add_argument("--max-grad-norm", type=_positive_float, help="clip gradients to this global L2 norm")
    p.set_defaults(fn=_cmd_export_web)

    p = sub.add_parser("web-demo", help="write (and serve) a page that trains a digit classifier in the browser")
    p.add_argument("-o", "--output", help="the folder to write (default: a temporary one, with --serve)")
    p.add_argument("--serve", action="store_true", help="serve the folder on localhost with Python's http.server")
    p.add_argument("--port", type=_integer(0), default=8000, help="with --serve (default 8000; 0: any free port)")
    p.add_argument("--ort-web", help="onnxruntime-web's dist folder (default: node_modules/onnxruntime-web/dist "
                                     "here or above)")
    _common(p)
    p.set_defaults(fn=_cmd_web_demo)

    p = sub.add_parser("ops", help="list the registered gradient rules")
    _common(p)
    p.set_defaults(fn=_cmd_ops)

    p = sub.add_parser("demo", help="check the gradients of a shipped model, train it, export it, measure it")
    p.add_argument("--steps", type=_integer(1), default=300, help="training steps (default 300)")
    p.add_argument("--output", help="also keep the trained inference model at this path")
    _common(p, progress=True)
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("train", help="train a model on arrays from an .npz file with onnxruntime")
    p.add_argument("model", help="path of the forward ONNX model")
    p.add_argument("--data", required=True, help=".npz file with one array per model input (same length on axis 0)")
    p.add_argument("--loss-name", help="the model's loss output (default: its first output); with --loss, the name of the "
                                       "appended one (default loss)")
    p.add_argument("--loss", help="append a loss instead: crossentropy, nll, mse, l1, bcewithlogits")
    p.add_argument("--loss-output", help="with --loss: the output it reads (default: the first output)")
    p.add_argument("--target", help="with --loss: name of its target input (default target)")
    p.add_argument("--optimizer", default="adamw", help=_optimizer_help())
    p.add_argument("--lr", type=_positive_float, help="learning rate (default 1e-3)")
    p.add_argument("--steps", type=_integer(1), default=300,
                   help="batches to train on in all, counting the checkpoint's with --resume (default 300)")
    p.add_argument("--batch-size", type=_integer(1), default=32, help="rows per step (default 32)")
    p.add_argument("--seed", type=_integer(0), help="shuffling seed (default 0)")
    p.add_argument("--weights", nargs="+", metavar="N", help=_WEIGHTS_HELP)
    p.add_argument("--frozen", nargs="+", metavar="N", help="weights not to train")
    p.add_argument("--max-grad-norm", type=_positive_float, help="clip gradients to this global L2 norm")
    p.add_argument("--accumulation-steps", type=_integer(1), default=1, help="micro-batches per update (default 1)")
    p.add_argument("--scheduler", choices=["linear", "cosine", "constant_with_warmup", "step"],
                   help="learning-rate schedule")
    p.add_argument("--warmup-steps", type=_integer(0), help="scheduler warm-up updates (default 0)")
    p.add_argument("--step-size", type=_integer(1), help="step scheduler: updates per decay (default 100)")
    p.add_argument("--gamma", type=_positive_float, help="step scheduler: decay factor (default 0.1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when usable, else CPU (default)")
    p.add_argument("--nproc-per-node", type=_integer(1), default=1,
                   help="train data parallel in N processes on this machine, started by torch's launcher (torchrun); "
                        "each takes 1/N of every batch (default 1)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0,
                   help="with --nproc-per-node: ZeRO stage (1: optimizer state partitioned, 2: and gradients)")
    p.add_argument("--resume", help="checkpoint to continue from: its weights, optimizer state, learning rate, "
                                    "schedule and data order (--lr, --scheduler and its options, --seed are ignored)")
    p.add_argument("--checkpoint", help="write a checkpoint here at the end, or when SIGINT (Ctrl-C) or SIGTERM "
                                        "stops training")
    p.add_argument("-o", "--output", help="write the trained model for inference here")
    p.add_argument("--keep", nargs="+", metavar="N", help="outputs of the inference model (default: all but the loss)")
    p.add_argument("--accuracy", metavar="OUTPUT:TARGET", type=_output_and_target,
                   help="report classification accuracy of OUTPUT (scores) against the data's TARGET array")
    p.add_argument("--eval-data", help=".npz for --accuracy (default: the training data)")
    _common(p, progress=True)
    p.set_defaults(fn=_cmd_train)
    return top


# ------------------------------------------------------------------ main


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"gradbuilder: {record.levelname.lower()}: {message}"
        if record.levelno < logging.INFO:
            return f"gradbuilder: debug: {record.name}: {message}"
        return message


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings`` as one line through the ``gradbuilder`` logger (what the user should change)."""
    kind = "" if category is UserWarning else f"{category.__name__}: "
    logging.getLogger("gradbuilder").warning("%s%s", kind, _one_line(message))


def _one_line(exc) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
    except _UsageError as exc:
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        return 2
    root = logging.getLogger("gradbuilder")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    level = root.level
    root.setLevel(logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO)
    root.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = _show_warning
            return args.fn(args)
    except GradBuilderError as exc:
        print(f"gradbuilder: error: {_one_line(exc)}", file=sys.stderr)
        return exit_status(exc)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except OSError as exc:  # a file that could not be written: disk full, permissions
        print(f"gradbuilder: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside training steps (while loading or building)
        print("gradbuilder: interrupted; nothing was saved", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
