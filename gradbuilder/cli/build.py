"""``gradbuilder build`` (the model with its gradient graph) and ``gradbuilder ops`` (the
registered gradient rules)."""

from __future__ import annotations

from .common import (allow_inference_export_option, check_distinct, check_input_file, check_output_file,
                     common_options)


def add_build(sub) -> None:
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
    allow_inference_export_option(p)
    common_options(p)
    p.set_defaults(fn=_cmd_build)


def _cmd_build(args) -> int:
    check_input_file("model", args.model)
    check_output_file("-o", args.output)
    check_distinct(**{"the model": args.model, "-o": args.output})
    from ..compiler.builder import GradientGraphBuilder, default_weights

    weights = args.weights or default_weights(args.model)
    outputs = args.outputs or [args.loss]
    b = GradientGraphBuilder(args.model, weights=weights, outputs=outputs, loss=args.loss,
                             allow_inference_export=args.allow_inference_export).build()
    b.save(args.output)
    t = b.timings
    print(f"wrote {args.output}: {len(weights)} weight gradients "
          f"(load {t['load']:.2f}s, differentiate {t['differentiate']:.2f}s, serialize {t['serialize']:.2f}s)")
    return 0


def add_ops(sub) -> None:
    p = sub.add_parser("ops", help="list the registered gradient rules")
    common_options(p)
    p.set_defaults(fn=_cmd_ops)


def _cmd_ops(args) -> int:
    from ..compiler import registry

    rules = registry.all_rules()
    print(f"{len(rules)} gradient rules")
    print(f"{'domain':16s} {'op_type':34s} since opset")
    for r in rules:
        print(f"{r.domain or 'ai.onnx':16s} {r.op_type:34s} {r.since}")
    return 0
