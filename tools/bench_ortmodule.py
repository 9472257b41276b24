"""ORTModule benchmark: the training step of ``ORTModule(model)`` against PyTorch eager, on the
transformer of ``bench_train.py``, side by side in one process.

    python tools/bench_ortmodule.py                          # CPU, 2 threads, seq 128, batch 8
    python tools/bench_ortmodule.py --threads 4 --steps 50 --json out.json
    python tools/bench_ortmodule.py --device cuda
    python tools/bench_ortmodule.py --steps 3 --warmup 1 --seq 64       # a quick smoke run
    python tools/bench_ortmodule.py --breaks 2          # the cost of graph breaks (see below)
    python tools/bench_ortmodule.py --model qwen3 --seq 64   # a current LLM (or --model mixtral)

The model is ``benchmodels.EncoderClassifier`` (Embedding(8000, 256) + learned positions
[seq, 256] + 4 x TransformerEncoderLayer(256, 4 heads, ff 1024, dropout 0, batch_first) + mean
over the sequence + Linear(256, 10)), built once from ``torch.manual_seed(0)``; each contender
trains its own deep copy, so both start from the same weights:

- ``pytorch``:    the module itself, eager;
- ``ortmodule``:  ``ORTModule(module, session_options=...)``: forward and backward in
                  onnxruntime, with ``intra_op_num_threads = --threads``.

``--model qwen3`` and ``--model mixtral`` train a current decoder LLM instead, transformers' own
class from a config sized for a CPU (random weights, ``torch.manual_seed(0)``): vocab 8000,
hidden 256, 4 layers, 8 query heads sharing 2 key/value heads of 32 (grouped-query attention),
RMSNorm, rotary positions, SwiGLU; Qwen3's MLP 768 wide and its query/key norms, Mixtral's 4
experts of 384 with 2 chosen per token (the routing in the graph). Its loss is the model's own
causal-LM loss, ``model(input_ids=tokens, labels=tokens).loss``, default (``sdpa``) attention.
``graph nodes`` counts the nodes of the forward and backward graphs the ORTModule hands
onnxruntime (Constants left out), before onnxruntime's own optimizations; ``node executions``
what onnxruntime's profiler saw run in one steady step (forward and backward sessions, as
``bench_nodes.py`` counts: all, computing, shape computations), on the CPU, after the timing.

One training step, the same for both (the encoder's; an LLM's loss as above): ``zero_grad(set_to_none=True)``, ``logits =
model(tokens)``, ``loss = cross_entropy(logits, labels)`` in PyTorch (outside the ORTModule),
``loss.backward()``, ``torch.optim.AdamW(lr=1e-3).step()``. Every step has a batch of its own
(int64 tokens [batch, seq], labels [batch], from a fixed seed); step i of both contenders uses
the same batch. ``torch.set_num_threads(--threads)`` for both.

Each contender runs its ``--warmup`` steps (the ORTModule's first step exports the module,
builds the forward and backward graphs and their onnxruntime sessions), then the ``--steps``
measured steps run in ``--rounds`` rounds in which the contenders take turns, so background
load on the machine hits both alike (``benchmodels.run_interleaved``). On CUDA the device is
synchronized before and after every timed step.

Printed numbers:

- ``first call``: the ORTModule's first forward call, which exports and builds (torch's ONNX
  export, the gradient graph, the forward/backward split, two sessions) and then runs the
  forward once; PyTorch's first forward is shown beside it.
- ``pytorch ms``, ``ortmodule ms``: median step time over the measured steps;
  ``ratio`` = ortmodule / pytorch.
- ``loss rel``: max over all steps of |l_ort - l_pt| / max(|l_ort|, |l_pt|, 1e-3 l_0) (as in
  ``bench_train.py``). Both runs compute the same training from the same weights and batches:
  the curves agree to float rounding. Above 1e-3 a WARNING is printed: the timings then compare
  different computations.

``--breaks N`` measures what graph breaks cost: a ``torch.autograd.Function`` that passes its
input on (``Passthrough``: a copy forward, the gradient unchanged backward) is applied to the
output of each of the first N encoder layers (by a forward hook), in both contenders, and a
third contender, ``ortmodule-plain``, trains ``ORTModule`` of the module without them (the same
computation, one graph). ``per break`` = (ortmodule - ortmodule-plain) / N.

``--json PATH`` writes the settings, every step time and every loss.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import time

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F

import benchlib
import benchmodels as bt  # the model and helpers bench_train uses too
from gradbuilder.ortmodule import ORTModule


def make_batches(n: int, batch: int, seq: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of (int64 tokens [batch, seq], int64 labels [batch]), from a fixed seed."""
    rng = np.random.default_rng(0)
    return [(torch.from_numpy(rng.integers(0, 8000, (batch, seq), dtype=np.int64)).to(device),
             torch.from_numpy(rng.integers(0, 10, (batch,), dtype=np.int64)).to(device)) for _ in range(n)]


class Trainer:
    """One contender for ``benchmodels.timed_steps``: step() trains on the next batch and returns
    the loss tensor; the first forward call is timed on its own."""

    def __init__(self, model: torch.nn.Module, batches, device: str, lm: bool = False):
        self.model = model.train()
        self.lm = lm
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=bt.LR)
        self.batches = batches
        self.device = device
        self.calls = 0
        self.first_call_s: float | None = None

    def step(self):
        x, y = self.batches[self.calls % len(self.batches)]
        self.opt.zero_grad(set_to_none=True)
        def forward():
            return self.model(input_ids=x, labels=x).loss if self.lm else self.model(x)

        if self.calls == 0:
            bt.sync(self.device)
            t0 = time.perf_counter()
            out = forward()
            bt.sync(self.device)
            self.first_call_s = time.perf_counter() - t0
        else:
            out = forward()
        loss = out if self.lm else F.cross_entropy(out, y)
        loss.backward()
        self.opt.step()
        self.calls += 1
        return loss.detach()

    @staticmethod
    def loss(value) -> float:
        return float(value)


class Passthrough(torch.autograd.Function):
    """A Function that changes nothing: the input copied forward, the gradient passed back."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


LLMS = {  # transformers config class, what differs from LLM_COMMON
    "qwen3": ("Qwen3Config", {"intermediate_size": 768}),
    "mixtral": ("MixtralConfig", {"intermediate_size": 384, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
LLM_COMMON = dict(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=False, attention_dropout=0.0)


def llm(name: str, seq: int) -> torch.nn.Module:
    """transformers' causal LM ``name`` from the config above, random weights from seed 0."""
    import transformers

    config_class, extra = LLMS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**LLM_COMMON, **extra, max_position_embeddings=max(seq, 128))
    return transformers.AutoModelForCausalLM.from_config(config)


def the_compiled(model: ORTModule):
    """The forward and backward graphs of ``model``'s one export (of its first batch shape, for
    an export that holds for the traced sizes only)."""
    (compiled,) = model.compiled_graphs.values()
    return next(iter(compiled.values())) if isinstance(compiled, dict) else compiled


def graph_nodes(model: ORTModule) -> int:
    """Nodes (Constants left out) of the forward and backward graphs of ``model``'s one export."""
    compiled = the_compiled(model)
    return sum(sum(n.op_type != "Constant" for n in g.graph.node)
               for g in (compiled.split.forward, compiled.split.backward))


def profiled_nodes(module: torch.nn.Module, batches, threads: int, lm: bool) -> dict:
    """Node executions of one steady ORTModule training step (forward and backward sessions,
    the third of three steps), counted as ``bench_nodes.py`` counts them (onnxruntime's
    profiler): all, the computing ones (views left out), the shape computations."""
    import os
    import tempfile

    from bench_nodes import SHAPES, VIEWS, last_run_nodes

    so = bt.session_options(threads)
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ortmodule")
    trainer = Trainer(ORTModule(copy.deepcopy(module), session_options=so), batches, "cpu", lm)
    for _ in range(3):
        trainer.step()
    compiled = the_compiled(trainer.model)
    counts = collections.Counter()
    for graph in (compiled.forward_graph, compiled.backward_graph):
        counts += last_run_nodes(graph.session.end_profiling())[0]
    return {"all": sum(counts.values()), "computing": sum(v for k, v in counts.items() if k not in VIEWS),
            "shape computations": sum(counts[k] for k in SHAPES)}


def with_breaks(module: torch.nn.Module, n: int) -> torch.nn.Module:
    """``module`` with ``Passthrough`` applied to the output of its first ``n`` encoder layers."""
    for layer in list(module.enc.layers)[:n] if n else []:
        layer.register_forward_hook(lambda mod, args, out: Passthrough.apply(out))
    return module


def loss_rel_diff(reference: list[float], other: list[float]) -> tuple[float, int, float]:
    """benchmodels.loss_rel_diff over every step, the floor 1e-3 x the reference's first loss."""
    return bt.loss_rel_diff(reference, other, bt.LOSS_FLOOR * abs(reference[0]))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch and onnxruntime intra-op threads (default 2)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps, not measured, the first call included "
                                                           "(default 3)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="the measured steps run in this many rounds, the contenders taking turns (default 3; "
                         "at most --steps)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    ap.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    ap.add_argument("--model", choices=("encoder", *LLMS), default="encoder",
                    help="the encoder classifier (default) or a current decoder LLM")
    ap.add_argument("--breaks", type=int, default=0,
                    help="graph breaks: a pass-through Function after each of the first N encoder layers (0-4)")
    ap.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--warmup, --steps, --rounds and --threads must be >= 1")
    if args.breaks and args.model != "encoder":
        ap.error("--breaks applies to --model encoder")
    if not 0 <= args.breaks <= 4:
        ap.error("--breaks must be between 0 and 4 (the encoder's layers)")
    args.rounds = min(args.rounds, args.steps)
    bt.check_device(ap, args.device)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, device {args.device}, threads {args.threads}")
    lm = args.model != "encoder"
    shape = (f"{args.model} (vocab 8000, hidden 256, 4 layers, 8 heads / 2 key-value heads)" if lm else
             "transformer (vocab 8000, d 256, 4 layers, 4 heads, ff 1024)")
    print(f"{shape} seq {args.seq}, batch {args.batch}; "
          f"AdamW lr {bt.LR:g}; median of {args.steps} steps in {args.rounds} rounds after {args.warmup} warm-up")
    print(f"CPU pressure before: {benchlib.pressure_line()}")

    torch.manual_seed(0)
    module = (llm(args.model, args.seq) if lm else bt.EncoderClassifier(seq=args.seq)).to(args.device)
    batches = make_batches(args.warmup + args.steps, args.batch, args.seq, args.device)
    contenders = {
        "pytorch": Trainer(with_breaks(copy.deepcopy(module), args.breaks), batches, args.device, lm),
        "ortmodule": Trainer(ORTModule(with_breaks(copy.deepcopy(module), args.breaks),
                                       session_options=bt.session_options(args.threads)), batches, args.device, lm),
    }
    if args.breaks:
        print(f"graph breaks: a pass-through Function after each of the first {args.breaks} encoder layers")
        contenders["ortmodule-plain"] = Trainer(ORTModule(copy.deepcopy(module),
                                                          session_options=bt.session_options(args.threads)),
                                                batches, args.device)
    times, losses, _ = bt.run_interleaved(contenders, args)
    print(f"CPU pressure after: {benchlib.pressure_line()}")
    reference = (bt.float64_losses(module, batches, lambda model, b: F.cross_entropy(model(b[0]), b[1]))
                 if args.device == "cpu" and not lm else None)
    nodes = graph_nodes(contenders["ortmodule"].model)
    executed = profiled_nodes(module, batches, args.threads, lm) if args.device == "cpu" else None
    print(f"graph nodes (forward + backward, as handed to onnxruntime): {nodes}; node executions per step "
          f"(onnxruntime's profiler, as bench_nodes.py counts them): {executed}")
    del module

    pt_ms, ort_ms = bt.median_ms(times["pytorch"], args.warmup), bt.median_ms(times["ortmodule"], args.warmup)
    rel, rel_step = loss_rel_diff(losses["pytorch"], losses["ortmodule"])[:2]
    first_call_s = contenders["ortmodule"].first_call_s
    pt_first_s = contenders["pytorch"].first_call_s
    print(f"ORTModule first call: {first_call_s:.2f} s (export, gradient graph, sessions, first forward); "
          f"its first step {times['ortmodule'][0]:.2f} s; PyTorch first forward {pt_first_s:.3f} s")
    print(f"loss: step 0 pytorch {losses['pytorch'][0]:.6f}, ortmodule {losses['ortmodule'][0]:.6f}; "
          f"last pytorch {losses['pytorch'][-1]:.6f}, ortmodule {losses['ortmodule'][-1]:.6f}")
    head = f"{'pytorch ms':>11}{'ortmodule ms':>14}{'ratio':>8}{'loss rel':>11}"
    print(head)
    print("-" * len(head))
    print(f"{pt_ms:>11.2f}{ort_ms:>14.2f}{ort_ms / pt_ms:>8.2f}{rel:>11.1e}")
    plain_ms = None
    if args.breaks:
        plain_ms = bt.median_ms(times["ortmodule-plain"], args.warmup)
        print(f"ortmodule-plain (no breaks) {plain_ms:.2f} ms ({plain_ms / pt_ms:.2f}x pytorch); per break "
              f"{(ort_ms - plain_ms) / args.breaks:.2f} ms ({(ort_ms - plain_ms) / args.breaks / plain_ms:.1%} of "
              f"the plain step); loss rel {loss_rel_diff(losses['pytorch'], losses['ortmodule-plain'])[0]:.1e}")
    if reference is not None:
        pt64, ort64 = loss_rel_diff(reference, losses["pytorch"])[0], loss_rel_diff(reference, losses["ortmodule"])[0]
        print(f"against PyTorch in float64: pytorch {pt64:.2e}, ortmodule {ort64:.2e}")
        if not ort64 <= bt.LOSS_SLACK * pt64 + bt.LOSS_TOLERANCE:
            print(f"!!!!! WARNING: the ORTModule loss curve strays from float64 more than PyTorch's float32 one "
                  f"({ort64:.2e} > {bt.LOSS_SLACK:g} x {pt64:.2e} + {bt.LOSS_TOLERANCE:g}) !!!!!")

    results = {"pytorch_ms": pt_ms, "ortmodule_ms": ort_ms, "ratio": ort_ms / pt_ms, "ortmodule_plain_ms": plain_ms,
               "graph_nodes": nodes, "node_executions": executed, "ortmodule_first_call_s": first_call_s, "ortmodule_first_step_s": times["ortmodule"][0],
               "pytorch_first_call_s": pt_first_s, "loss_max_rel_diff": rel, "loss_max_rel_diff_step": rel_step,
               "losses": losses, "times_s": times}
    if args.json:
        settings = {k: getattr(args, k) for k in ("model", "device", "threads", "steps", "warmup", "rounds", "seq",
                                                  "batch", "breaks")}
        settings.update(torch=torch.__version__, onnxruntime=ort.__version__)
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
