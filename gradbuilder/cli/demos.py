"""``gradbuilder demo`` (check, train, export and measure a shipped model) and ``gradbuilder
web-demo`` (a page that trains a digit classifier in the browser)."""

from __future__ import annotations

from ..errors import InvalidArgumentError
from .common import check_output_file, common_options, integer, progress


def add_web_demo(sub) -> None:
    p = sub.add_parser("web-demo", help="write (and serve) a page that trains a digit classifier in the browser")
    p.add_argument("-o", "--output", help="the folder to write (default: a temporary one, with --serve)")
    p.add_argument("--serve", action="store_true", help="serve the folder on localhost with Python's http.server")
    p.add_argument("--port", type=integer(0), default=8000, help="with --serve (default 8000; 0: any free port)")
    p.add_argument("--ort-web", help="onnxruntime-web's dist folder (default: node_modules/onnxruntime-web/dist "
                                     "here or above)")
    common_options(p)
    p.set_defaults(fn=_cmd_web_demo)


def _cmd_web_demo(args) -> int:
    import tempfile

    from .. import webdemo

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


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="check the gradients of a shipped model, train it, export it, measure it")
    p.add_argument("--steps", type=integer(1), default=300, help="training steps (default 300)")
    p.add_argument("--output", help="also keep the trained inference model at this path")
    common_options(p, progress=True)
    p.set_defaults(fn=_cmd_demo)


def _cmd_demo(args) -> int:
    check_output_file("--output", args.output)
    from ..demo import run

    return 0 if run(steps=args.steps, output=args.output, progress=progress(args)) else 1
