"""The `gradbuilder` command: build, artifacts, ops, demo."""

from __future__ import annotations

import argparse
import sys
import warnings

from .errors import GradBuilderError


def _cmd_build(args) -> int:
    from .builder import GradientGraphBuilder, float_initializers

    if args.weights and args.all_initializers:
        raise GradBuilderError("give either --weights or --all-initializers, not both")
    weights = args.weights or float_initializers(args.model)
    outputs = args.outputs or [args.loss]
    b = GradientGraphBuilder(args.model, weights=weights, outputs=outputs, loss=args.loss).build()
    b.save(args.output)
    t = b.timings
    print(f"wrote {args.output}: {len(weights)} weight gradients "
          f"(load {t['load']:.2f}s, differentiate {t['differentiate']:.2f}s, serialize {t['serialize']:.2f}s)")
    return 0


def _cmd_artifacts(args) -> int:
    from .artifacts import generate_artifacts

    written = generate_artifacts(args.model, requires_grad=args.weights, frozen_params=args.frozen or (),
                                 loss=args.loss, optimizer=args.optimizer, artifact_directory=args.output,
                                 loss_output=args.loss_output)
    for path in written.values():
        print(f"wrote {path}")
    return 0


def _cmd_ops(args) -> int:
    from . import registry

    rules = registry.all_rules()
    print(f"{len(rules)} gradient rules")
    print(f"{'domain':16s} {'op_type':34s} since opset")
    for r in rules:
        print(f"{r.domain or 'ai.onnx':16s} {r.op_type:34s} {r.since}")
    return 0


def _cmd_demo(args) -> int:
    from .demo import run

    return 0 if run(steps=args.steps, output=args.output) else 1


def _cmd_train(args) -> int:
    import numpy as np

    from . import TrainingParameters, modelio
    from .loop import BATCHES_SEEN, accuracy, fit
    from .session import TrainingSession

    model = modelio.load_proto(args.model)
    loss_name = args.loss_name
    if args.loss:
        from .passes.loss import append_loss

        output = args.loss_output or model.graph.output[0].name
        loss_name = loss_name or "loss"
        model = append_loss(model, args.loss, output, target_name=args.target, loss_name=loss_name)
    loss_name = loss_name or model.graph.output[0].name
    with np.load(args.data, allow_pickle=False) as npz:
        data = {k: npz[k] for k in npz.files}
    params = TrainingParameters(loss_output_name=loss_name, training_optimizer_name=args.optimizer,
                                enable_grad_norm_clip=args.max_grad_norm is not None,
                                gradient_accumulation_steps=args.accumulation_steps)
    if args.weights:
        params.weights_to_train = args.weights
    if args.frozen:
        params.weights_not_to_train = args.frozen
    if args.max_grad_norm is not None:
        from .builder import float_initializers

        weights = args.weights or [w for w in float_initializers(model) if w not in (args.frozen or [])]
        params.optimizer_attributes_map = {w: {"max_norm_clip": args.max_grad_norm} for w in weights}
    providers = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
                 "auto": None}[args.device]
    session = TrainingSession(model.SerializeToString(), params, providers=providers)
    done = 0
    if args.resume:
        session.load_checkpoint(args.resume)
        done = int(session.properties.get(BATCHES_SEEN, session.step * args.accumulation_steps))
        ignored = [f"--{k.replace('_', '-')}" for k in _RESUMED if getattr(args, k) is not None]
        print(f"resumed from {args.resume} at step {session.step} ({done} batches), learning rate "
              f"{session.get_learning_rate():g}" + (f"; the checkpoint's learning rate, schedule and data order "
                                                   f"continue, so {' '.join(ignored)} are ignored" if ignored else ""))
    else:
        session.set_learning_rate(args.lr if args.lr is not None else 1e-3)
        if args.scheduler:
            session.register_scheduler(args.scheduler, **_scheduler_args(args))
    print(f"training {args.model} on {session.get_providers()[0]}: {len(session.weights)} weights "
          f"({session.get_parameters_size():,} values), {args.optimizer}, lr {session.get_learning_rate():g}, "
          f"batch {args.batch_size}")
    if done >= args.steps:
        print(f"nothing to train: the checkpoint has seen {done} batches and --steps is {args.steps}")
        losses = []
    else:
        losses = fit(session, data, args.steps - done, args.batch_size,
                     seed=args.seed if args.seed is not None else 0)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {done + len(losses)} steps")
    if args.checkpoint:
        session.save_checkpoint(args.checkpoint)
        print(f"wrote checkpoint {args.checkpoint}")
    if args.output:
        keep = args.keep or [o.name for o in model.graph.output if o.name != loss_name] or [loss_name]
        session.export_model_for_inferencing(args.output, keep)
        print(f"wrote {args.output} (outputs {', '.join(keep)})")
    if args.accuracy:
        scores_name, _, target = args.accuracy.partition(":")
        evaluation = data
        if args.eval_data:
            with np.load(args.eval_data, allow_pickle=False) as npz:
                evaluation = {k: npz[k] for k in npz.files}
        if target not in evaluation:
            raise GradBuilderError(f"--accuracy {args.accuracy}: the data has no array '{target}'")
        scores = _evaluate(session, model, scores_name, evaluation, args.batch_size)
        print(f"accuracy ({scores_name} vs {target}): {accuracy(scores, evaluation[target][: len(scores)]):.1%}")
    return 0


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


def _evaluate(session, model, output: str, data, batch_size: int):
    """``output`` of the model with the trained weights over ``data``, in whole batches."""
    import tempfile
    from pathlib import Path

    import numpy as np
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "trained.onnx")
        session.export_model_for_inferencing(path, [output])
        infer = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [i.name for i in infer.get_inputs()]
        n = len(data[names[0]]) // batch_size * batch_size
        parts = [infer.run([output], {k: data[k][i: i + batch_size] for k in names})[0]
                 for i in range(0, n, batch_size)]
    return np.concatenate(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gradbuilder", description="Gradient graphs for ONNX models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="write the model with its gradient graph")
    p.add_argument("model", help="path of the forward ONNX model")
    p.add_argument("--loss", required=True, help="name of the scalar loss value")
    p.add_argument("--weights", nargs="+", metavar="N", help="values to differentiate")
    p.add_argument("--all-initializers", action="store_true",
                   help="differentiate every float initializer (the default without --weights)")
    p.add_argument("--outputs", nargs="+", metavar="N", help="values kept as outputs (default: the loss)")
    p.add_argument("-o", "--output", required=True, help="path of the model to write")
    p.set_defaults(fn=_cmd_build)
    p = sub.add_parser("artifacts", help="write training, eval and optimizer models and a checkpoint")
    p.add_argument("model", help="path of the forward ONNX model")
    p.add_argument("--loss", help="append a loss: crossentropy, nll, mse, l1, bcewithlogits "
                                  "(default: the model's first output is the loss)")
    p.add_argument("--loss-output", help="the output the loss reads (default: the first output)")
    p.add_argument("--optimizer", default="adamw", help="sgd, adam, adamw, adagrad or lamb (default adamw)")
    p.add_argument("--weights", nargs="+", metavar="N", help="weights to train (default: every float initializer)")
    p.add_argument("--frozen", nargs="+", metavar="N", help="weights not to train")
    p.add_argument("-o", "--output", required=True, help="directory to write the artifacts into")
    p.set_defaults(fn=_cmd_artifacts)
    sub.add_parser("ops", help="list the registered gradient rules").set_defaults(fn=_cmd_ops)
    p = sub.add_parser("demo", help="check the gradients of a shipped model, train it, export it, measure it")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--output", help="also keep the trained inference model at this path")
    p.set_defaults(fn=_cmd_demo)
    p = sub.add_parser("train", help="train a model on arrays from an .npz file with onnxruntime")
    p.add_argument("model", help="path of the forward ONNX model")
    p.add_argument("--data", required=True, help=".npz file with one array per model input (same length on axis 0)")
    p.add_argument("--loss-name", help="the model's loss output (default: its first output); with --loss, the name of the "
                                         "appended one (default loss)")
    p.add_argument("--loss", help="append a loss instead: crossentropy, nll, mse, l1, bcewithlogits")
    p.add_argument("--loss-output", help="with --loss: the output it reads (default: the first output)")
    p.add_argument("--target", default="target", help="with --loss: name of its target input (default target)")
    p.add_argument("--optimizer", default="adamw", help="sgd, adam, adamw, adagrad or lamb (default adamw)")
    p.add_argument("--lr", type=float, help="learning rate (default 1e-3)")
    p.add_argument("--steps", type=int, default=300,
                   help="batches to train on in all, counting the checkpoint's with --resume (default 300)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per step (default 32)")
    p.add_argument("--seed", type=int, help="shuffling seed (default 0)")
    p.add_argument("--weights", nargs="+", metavar="N", help="weights to train (default: every float initializer)")
    p.add_argument("--frozen", nargs="+", metavar="N", help="weights not to train")
    p.add_argument("--max-grad-norm", type=float, help="clip gradients to this global L2 norm")
    p.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per update (default 1)")
    p.add_argument("--scheduler", choices=["linear", "cosine", "constant_with_warmup", "step"],
                   help="learning-rate schedule")
    p.add_argument("--warmup-steps", type=int, help="scheduler warm-up updates (default 0)")
    p.add_argument("--step-size", type=int, help="step scheduler: updates per decay (default 100)")
    p.add_argument("--gamma", type=float, help="step scheduler: decay factor (default 0.1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when usable, else CPU (default)")
    p.add_argument("--resume", help="checkpoint to continue from: its weights, optimizer state, learning rate, "
                                    "schedule and data order (--lr, --scheduler and its options, --seed are ignored)")
    p.add_argument("--checkpoint", help="write a checkpoint here at the end")
    p.add_argument("-o", "--output", help="write the trained model for inference here")
    p.add_argument("--keep", nargs="+", metavar="N", help="outputs of the inference model (default: all but the loss)")
    p.add_argument("--accuracy", metavar="OUTPUT:TARGET",
                   help="report classification accuracy of OUTPUT (scores) against the data's TARGET array")
    p.add_argument("--eval-data", help=".npz for --accuracy (default: the training data)")
    p.set_defaults(fn=_cmd_train)
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            return args.fn(args)
    except GradBuilderError as exc:
        print(f"gradbuilder: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
