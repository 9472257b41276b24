"""``gradbuilder artifacts`` (training, eval and optimizer models and a checkpoint for
onnxruntime's training API) and ``gradbuilder export-web`` (what a JavaScript program needs to
train the model): the same model, loss, optimizer and weight options."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidArgumentError
from .common import (
    WEIGHTS_HELP,
    allow_inference_export_option,
    check_input_file,
    check_output_directory,
    check_weights,
    common_options,
    optimizer_help,
    positive_float,
)


def _artifact_arguments(p) -> None:
    """What ``artifacts`` and ``export-web`` share: the model, its loss, the optimizer, the
    weights and the output directory."""
    p.add_argument("model", help="path of the forward ONNX model")
    p.add_argument("--loss", help="append a loss: crossentropy, nll, mse, l1, bcewithlogits "
                                  "(default: the model's first output is the loss)")
    p.add_argument("--loss-output", help="with --loss: the output it reads (default: the first output)")
    p.add_argument("--target", help="with --loss: name of its target input (default target)")
    p.add_argument("--optimizer", default="adamw", help=optimizer_help())
    p.add_argument("--weights", nargs="+", metavar="N", help=WEIGHTS_HELP)
    p.add_argument("--frozen", nargs="+", metavar="N", help="weights not to train")
    p.add_argument("-o", "--output", required=True, help="directory to write the artifacts into (made if missing)")
    allow_inference_export_option(p)
    common_options(p)


def add_artifacts(sub) -> None:
    p = sub.add_parser("artifacts", help="write training, eval and optimizer models and a checkpoint")
    _artifact_arguments(p)
    p.set_defaults(fn=_cmd_artifacts)


def _cmd_artifacts(args) -> int:
    check_input_file("model", args.model)
    check_output_directory("-o", args.output)
    if args.loss is None and (args.loss_output or args.target):
        raise InvalidArgumentError(f"{'--loss-output' if args.loss_output else '--target'} needs --loss")
    if args.weights or args.frozen:
        from ..compiler import modelio
        from ..compiler.builder import float_values

        check_weights(args, float_values(modelio.load_proto(args.model, external=False)))
    from ..training.artifacts import generate_artifacts

    written = generate_artifacts(args.model, requires_grad=args.weights, frozen_params=args.frozen or (),
                                 loss=args.loss, optimizer=args.optimizer, artifact_directory=args.output,
                                 loss_output=args.loss_output, target_name=args.target or "target",
                                 allow_inference_export=args.allow_inference_export)
    for path in written.values():
        print(f"wrote {path}")
    return 0


def add_export_web(sub) -> None:
    p = sub.add_parser("export-web", help="write what a JavaScript program needs to train the model with "
                                          "onnxruntime-web or onnxruntime-node")
    _artifact_arguments(p)
    p.add_argument("--lr", type=positive_float, default=1e-3, help="the learning rate the manifest starts with "
                                                                   "(default 1e-3)")
    p.add_argument("--max-grad-norm", type=positive_float, help="clip gradients to this global L2 norm")
    p.set_defaults(fn=_cmd_export_web)


def _cmd_export_web(args) -> int:
    check_input_file("model", args.model)
    if args.loss is None and (args.loss_output or args.target):
        raise InvalidArgumentError("--loss-output and --target need --loss")
    from ..training.web import export_web

    written = export_web(args.model, args.output, loss=args.loss, loss_output=args.loss_output,
                         target_name=args.target or "target", optimizer=args.optimizer, lr=args.lr,
                         requires_grad=args.weights, frozen_params=args.frozen or (),
                         max_grad_norm=args.max_grad_norm, allow_inference_export=args.allow_inference_export)
    print(f"wrote {len(written)} files to {args.output}: {', '.join(Path(p).name for p in written.values())}")
    print(f"train them with: node examples/train.mjs {args.output}  (gradbuilder-train.mjs: {_web_module()})")
    return 0


def _web_module() -> str:
    from ..webdemo import WEB

    return str(WEB / "gradbuilder-train.mjs")
