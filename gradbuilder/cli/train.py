"""``gradbuilder train``: train a model on arrays from an .npz file with onnxruntime, in one
process or data parallel in several (torch's launcher starts them), stopped cleanly by SIGINT or
SIGTERM between steps, resumed from a checkpoint.

Everything the command line decides is checked before a graph is built or a step runs
(``train_checks``); the arrays are read there too."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import warnings

from ..errors import CheckpointError, DistributedError, InvalidArgumentError
from .common import (
    WEIGHTS_HELP,
    allow_inference_export_option,
    check_distinct,
    check_input_file,
    check_output_file,
    check_weights,
    common_options,
    integer,
    one_line,
    optimizer_help,
    output_and_target,
    positive_float,
    progress,
)
from .train_checks import check_model_names, check_train_options, evaluate, load_arrays

log = logging.getLogger("gradbuilder.cli")

# what a checkpoint decides when training resumes from it
_RESUMED = ("lr", "scheduler", "warmup_steps", "step_size", "gamma", "seed")

_PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
              "auto": None}


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model on arrays from an .npz file with onnxruntime")
    p.add_argument("model", help="path of the forward ONNX model")
    p.add_argument("--data", required=True, help=".npz file with one array per model input (same length on axis 0)")
    p.add_argument("--loss-name", help="the model's loss output (default: its first output); with --loss, the name of the "
                                       "appended one (default loss)")
    p.add_argument("--loss", help="append a loss instead: crossentropy, nll, mse, l1, bcewithlogits")
    p.add_argument("--loss-output", help="with --loss: the output it reads (default: the first output)")
    p.add_argument("--target", help="with --loss: name of its target input (default target)")
    p.add_argument("--optimizer", default="adamw", help=optimizer_help())
    p.add_argument("--lr", type=positive_float, help="learning rate (default 1e-3)")
    p.add_argument("--steps", type=integer(1), default=300,
                   help="batches to train on in all, counting the checkpoint's with --resume (default 300)")
    p.add_argument("--batch-size", type=integer(1), default=32, help="rows per step (default 32)")
    p.add_argument("--seed", type=integer(0), help="shuffling seed (default 0)")
    p.add_argument("--weights", nargs="+", metavar="N", help=WEIGHTS_HELP)
    p.add_argument("--frozen", nargs="+", metavar="N", help="weights not to train")
    p.add_argument("--max-grad-norm", type=positive_float, help="clip gradients to this global L2 norm")
    p.add_argument("--accumulation-steps", type=integer(1), default=1, help="micro-batches per update (default 1)")
    allow_inference_export_option(p)
    p.add_argument("--scheduler", choices=["linear", "cosine", "constant_with_warmup", "step"],
                   help="learning-rate schedule")
    p.add_argument("--warmup-steps", type=integer(0), help="scheduler warm-up updates (default 0)")
    p.add_argument("--step-size", type=integer(1), help="step scheduler: updates per decay (default 100)")
    p.add_argument("--gamma", type=positive_float, help="step scheduler: decay factor (default 0.1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when usable, else CPU (default)")
    p.add_argument("--nproc-per-node", type=integer(1), default=1,
                   help="train data parallel in N processes on this machine, started by torch's launcher (torchrun); "
                        "each takes 1/N of every batch (default 1)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0,
                   help="with --nproc-per-node: ZeRO stage (1: optimizer state partitioned, 2: and gradients)")
    p.add_argument("--resume", help="checkpoint to continue from: its weights, optimizer state, learning rate, "
                                    "schedule and data order (--lr, --scheduler and its options, --seed are ignored); "
                                    "'auto': the newest complete checkpoint of --checkpoint's (periodic ones included)")
    p.add_argument("--checkpoint", help="write a checkpoint here at the end, or when SIGINT (Ctrl-C) or SIGTERM "
                                        "stops training, or when another process of the run dies")
    p.add_argument("--save-every", type=integer(1), metavar="N",
                   help="also write a checkpoint every N optimizer updates beside --checkpoint (CK.updateNNNNNNNN.ext, "
                        "atomically): a crash loses at most the updates since the last one")
    p.add_argument("--keep-last", type=integer(1), default=2, metavar="K",
                   help="with --save-every: keep the newest K periodic checkpoints (default 2)")
    p.add_argument("--max-restarts", type=integer(0), metavar="N",
                   help="with --nproc-per-node: when a process fails, torch's launcher restarts them all, up to N "
                        "times; each restart resumes from the newest complete checkpoint (needs --checkpoint)")
    p.add_argument("-o", "--output", help="write the trained model for inference here")
    p.add_argument("--keep", nargs="+", metavar="N", help="outputs of the inference model (default: all but the loss)")
    p.add_argument("--accuracy", metavar="OUTPUT:TARGET", type=output_and_target,
                   help="report classification accuracy of OUTPUT (scores) against the data's TARGET array")
    p.add_argument("--eval-data", help=".npz for --accuracy (default: the training data)")
    common_options(p, progress=True)
    p.set_defaults(fn=_cmd_train)


def _cmd_train(args) -> int:
    # Everything the command line decides is checked before a graph is built or a step runs.
    data, evaluation = _check_files(args)
    from ..runtime.distributed import launched

    group = launched()
    world = group[1] if group is not None else args.nproc_per_node
    if args.batch_size % world:
        raise InvalidArgumentError(f"--batch-size {args.batch_size} must be divisible by the {world} processes "
                                   "(each takes an equal share of every batch)")
    if args.zero_stage and world == 1:
        raise InvalidArgumentError("--zero-stage needs --nproc-per-node N > 1 (it partitions state across processes)")
    if args.max_restarts is not None and world == 1:
        raise InvalidArgumentError("--max-restarts needs --nproc-per-node N > 1 (torch's launcher restarts the "
                                   "processes); a single process resumes with --resume auto")
    if world > 1 and group is None:
        return _launch(args)
    main_rank = group is None or group[0] == 0  # the one that reports and writes files
    if not main_rank:
        logging.getLogger("gradbuilder").setLevel(logging.WARNING)

    from ..compiler.builder import float_values
    from ..runtime.loop import BATCHES_SEEN, fit
    from ..runtime.session import TrainingSession
    from ..training.loaded import LossBlock, load

    params = _parameters(args)
    block = LossBlock(args.loss, args.loss_output, args.target or "target", args.loss_name or "loss") if args.loss else None
    loaded = load(args.model, params, loss=block, check=lambda proto: check_weights(args, float_values(proto)))
    keep = check_model_names(args, loaded.proto, loaded.loss, data, evaluation)
    params.loss_output_name = loaded.loss
    if args.max_grad_norm is not None:
        params.optimizer_attributes_map = {w: {"max_norm_clip": args.max_grad_norm} for w in loaded.weights}
    session = TrainingSession(loaded, params, providers=_PROVIDERS[args.device])
    del loaded
    done = _start(args, session)

    losses: list[float] = []
    with _Stop() as stop:
        log.info("training %s on %s: %d weights (%s values), %s, lr %g, batch %d", args.model,
                 session.get_providers()[0], len(session.weights), f"{session.get_parameters_size():,}",
                 args.optimizer, session.get_learning_rate(), args.batch_size)
        if done >= args.steps:
            log.info("nothing to train: the checkpoint has seen %d batches and --steps is %d", done, args.steps)
        else:
            try:
                losses = fit(session, data, args.steps - done, args.batch_size,
                             seed=args.seed if args.seed is not None else 0,
                             progress=progress(args) if main_rank else False, stop=stop,
                             checkpoint=args.checkpoint, save_every=args.save_every, keep_last=args.keep_last)
            except DistributedError as exc:  # another process died or failed: save what can be saved
                raise DistributedError(f"{exc}; {_survivor_saves(args, session)}") from exc
        if stop.signum is not None:  # handlers stay in place while the checkpoint is written
            return _stopped(args, session, stop.signum, int(session.properties.get(BATCHES_SEEN, done)))
    if args.checkpoint:  # every rank takes part; the first writes it
        session.save_checkpoint(args.checkpoint)
    if not main_rank:
        return 0
    return _finish(args, session, losses, done, world, keep, evaluation)


def _check_files(args) -> tuple[dict, dict]:
    """The options checked against each other, the files named checked, the arrays read:
    (training data, evaluation data)."""
    check_train_options(args)
    check_input_file("model", args.model)
    if args.resume and args.resume != "auto":
        check_input_file("--resume", args.resume)
    check_output_file("--checkpoint", args.checkpoint)
    check_output_file("-o", args.output)
    check_distinct(**{"the model": args.model, "--data": args.data, "--checkpoint": args.checkpoint, "-o": args.output})
    data = load_arrays("--data", args.data, args.batch_size)
    evaluation = load_arrays("--eval-data", args.eval_data, args.batch_size) if args.eval_data else data
    return data, evaluation


def _parameters(args):
    """The TrainingParameters the options ask for (the loss named once the model is loaded)."""
    from .. import TrainingParameters

    params = TrainingParameters(loss_output_name=args.loss_name or "", training_optimizer_name=args.optimizer,
                                enable_grad_norm_clip=args.max_grad_norm is not None,
                                gradient_accumulation_steps=args.accumulation_steps,
                                deepspeed_zero_stage=args.zero_stage,
                                allow_inference_export=args.allow_inference_export)
    if args.weights:
        params.weights_to_train = args.weights
    if args.frozen:
        params.weights_not_to_train = args.frozen
    return params


def _start(args, session) -> int:
    """Resume from ``--resume`` (``auto``, or a restart by torch's launcher: the newest complete
    checkpoint of the run) or set the learning rate and schedule: the batches already seen."""
    import os

    from ..runtime.loop import BATCHES_SEEN
    from ..runtime.periodic import CheckpointSeries

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if args.resume == "auto" or (restarted and args.checkpoint and not args.resume):
        try:
            resumed = CheckpointSeries(args.checkpoint, args.keep_last).resume(session)
        except CheckpointError as exc:
            raise InvalidArgumentError(f"--resume auto: {one_line(exc)}") from None
        if resumed is None:
            log.info("no checkpoint of %s yet: training from the start", args.checkpoint)
    elif args.resume:
        try:
            session.load_checkpoint(args.resume)
        except CheckpointError as exc:  # a file named on the command line that does not fit
            raise InvalidArgumentError(f"--resume {args.resume}: {one_line(exc)}") from None
        resumed = args.resume
        ignored = [f"--{k.replace('_', '-')}" for k in _RESUMED if getattr(args, k) is not None]
        if ignored:
            warnings.warn(f"{' '.join(ignored)} are ignored with --resume: the checkpoint's learning rate, schedule "
                          "and data order continue", UserWarning, stacklevel=1)
    else:
        resumed = None
    if resumed is None:
        session.set_learning_rate(args.lr if args.lr is not None else 1e-3)
        if args.scheduler:
            session.register_scheduler(args.scheduler, **_scheduler_args(args))
        return 0
    done = int(session.properties.get(BATCHES_SEEN, session.step * args.accumulation_steps))
    log.info("resumed from %s at step %d (%d batches), learning rate %g%s", resumed, session.step, done,
             session.get_learning_rate(), " after a restart" if restarted else "")
    return done


def _survivor_saves(args, session) -> str:
    """After another process failed: this one's consistent state saved where it holds all of it
    (data parallel without ZeRO: every process has the whole state after the last update all
    of them completed), and what the user can resume from, in words."""
    from ..runtime.periodic import CheckpointSeries

    if not args.checkpoint:
        return "nothing was saved (with --checkpoint PATH --save-every N a crash loses at most N updates)"
    series = CheckpointSeries(args.checkpoint, args.keep_last)
    if session.holds_whole_state():
        path = series.at(session.step)
        try:
            session.save_checkpoint(path, this_process_only=True)
        except Exception as exc:  # noqa: BLE001 - the error in hand is the one to report
            log.warning("could not save the surviving state to %s: %s", path, one_line(exc))
        else:
            return (f"saved the state after update {session.step} (the last one every process completed) to {path}; "
                    f"to continue, run the same command with --resume auto")
    newest = next(iter(series.candidates()), None)
    if newest is None:
        return "this process holds only part of the state (ZeRO or a pipeline stage) and no checkpoint was written yet"
    return (f"this process holds only part of the state (ZeRO or a pipeline stage); the newest checkpoint is {newest}: "
            "to continue from it, run the same command with --resume auto")


def _scheduler_args(args) -> dict:
    """The schedule's options; it steps once per update (``--accumulation-steps`` batches)."""
    if args.scheduler == "step":
        return {"step_size": args.step_size or 100, "gamma": args.gamma if args.gamma is not None else 0.1}
    kwargs = {"warmup_steps": args.warmup_steps or 0}
    if args.scheduler in ("linear", "cosine"):
        kwargs["total_steps"] = max(1, args.steps // args.accumulation_steps)
    return kwargs


def _finish(args, session, losses: list[float], done: int, world: int, keep: list[str], evaluation) -> int:
    """What the main rank reports and writes after training: the losses, the accuracy, the
    inference model."""
    from ..runtime.loop import accuracy

    if losses:
        shard = " (rank 0's share of each batch)" if world > 1 else ""
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {done + len(losses)} steps{shard}")
    score = None
    if args.accuracy:  # before the model is written: a failure here leaves no file behind
        scores_name, target = args.accuracy
        scores = evaluate(session, scores_name, evaluation, args.batch_size)
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


# ------------------------------------------------------------------ stopping and launching


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
        restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
        run.main(["--nproc-per-node", str(args.nproc_per_node), "--standalone", *restarts, "-m", "gradbuilder.cli",
                  *rest])
    except Exception as exc:  # noqa: BLE001 - torch's ChildFailedError names the failed rank
        print(f"gradbuilder: error: {one_line(exc)}", file=sys.stderr)
        return 1
    return 0
