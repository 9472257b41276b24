"""torch's two ONNX exporters on a current LLM: the TorchScript exporter ORTModule uses (with
its conversions, ``gradbuilder.ortmodule.conversions``) against ``dynamo=True``, for the
models of ``bench_ortmodule.py --model qwen3|mixtral``: whether each exports the training
forward (``model(input_ids=ids, labels=ids).loss``), its time, and the node count of the
exported forward graph (Constants left out; the dynamo export unoptimized, ``optimize=False``,
and optimized, as torch writes it by default).

    python tools/bench_exporters.py                    # qwen3 and mixtral, seq 128, batch 8
    python tools/bench_exporters.py --models qwen3 --seq 64
"""

from __future__ import annotations

import argparse
import copy
import io
import re
import time
import warnings

import onnx
import torch

import benchlib
from bench_ortmodule import LLMS, llm
from gradbuilder.ortmodule import export as ortmodule_export
from gradbuilder.ortmodule.conversions import converting


class Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss


def nodes(model: onnx.ModelProto) -> int:
    return sum(n.op_type != "Constant" for n in model.graph.node)


def torchscript(module, ids):
    f = io.BytesIO()
    with converting(module):
        torch.onnx.export(module, (ids,), f, dynamo=False, opset_version=ortmodule_export.OPSET,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["ids"], dynamic_axes={"ids": {0: "batch", 1: "seq"}})
    return onnx.load_from_string(f.getvalue())


def dynamo(module, ids, optimize: bool):
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    program = torch.onnx.export(module, (ids,), None, dynamo=True, optimize=optimize, verbose=False, report=False,
                                dynamic_shapes={"ids": {0: batch, 1: seq}})
    return program.model_proto


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(LLMS), default=list(LLMS))
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}; CPU pressure before: {benchlib.pressure_line()}")
    ids = torch.randint(0, 8000, (args.batch, args.seq))
    for name in args.models:
        module = Loss(llm(name, args.seq)).train()
        for exporter, run in (("torchscript + conversions", torchscript),
                              ("dynamo, optimize=False", lambda m, x: dynamo(m, x, False)),
                              ("dynamo, optimized", lambda m, x: dynamo(m, x, True))):
            start = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = run(copy.deepcopy(module), ids)
                result = f"{time.perf_counter() - start:6.1f} s  {nodes(model):5d} nodes"
            except Exception as exc:  # what each exporter says, in one line
                message = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()[0][:150]
                result = f"fails: {type(exc).__name__}: {message}"
            print(f"{name:8s} {exporter:27s} {result}", flush=True)
    print(f"CPU pressure after: {benchlib.pressure_line()}")


if __name__ == "__main__":
    main()
