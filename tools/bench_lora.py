"""LoRA training benchmark: a step of ``gradbuilder lora``'s training (TrainingSession on the
onnxruntime-genai model with LoRA inputs) against PyTorch + PEFT on the same float32
checkpoint, the same LoRA (targets, rank, alpha, initial A) and the same batch.

    python tools/bench_lora.py                     # Llama 512 wide, 8 layers, vocab 8000; seq 128, batch 4
    python tools/bench_lora.py --steps 4 --rounds 1 --warmup 1 --layers 2 --no-memory   # a quick run

The checkpoint is transformers' Llama with random weights (``torch.manual_seed(0)``): hidden
``--hidden``, ``--layers`` layers, 8 query heads sharing 4 key/value heads, MLP 2.75 x hidden,
vocab ``--vocab``; onnxruntime-genai's model builder turns it into a float32 and an int4
(MatMulNBits, block 32) model. Contenders, each training rank ``--rank`` (alpha 2 x rank)
adapters on q_proj and v_proj with AdamW (lr 1e-4) on one fixed batch of random tokens, right-
padded rows included:

- ``pytorch+peft``: ``peft.get_peft_model`` of the transformers model (default attention),
  ``zero_grad``, ``model(input_ids, attention_mask, labels).loss``, ``backward``, ``step``;
- ``gradbuilder fp32`` / ``gradbuilder int4``: ``TrainingSession.run`` on ``add_lora`` of the
  builder's model with the causal-LM loss (the training ``gradbuilder lora`` runs).

Speed: in one process, interleaved rounds (``benchmodels.run_interleaved``), median step
time; ``ratio`` = contender / pytorch+peft. Memory (unless ``--no-memory``): one child
process per contender, each importing the same libraries, then its peak resident set
(VmHWM) over the resident set before it loads its model, after ``--warmup`` + 3 steps.
``/proc/pressure/cpu`` is printed before and after; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGETS = ("q_proj", "v_proj")
CONTENDERS = ("pytorch+peft", "gradbuilder fp32", "gradbuilder int4")


def _sizes(args) -> dict:
    return dict(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab, max_position_embeddings=512)


def _batch(args, config: dict) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(4, args.vocab, (args.batch, args.seq)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1:, args.seq * 3 // 4:] = 0  # right padding
    decoder = config["model"]["decoder"]
    past = {f"past_key_values.{i}.{kv}": np.zeros((args.batch, decoder["num_key_value_heads"], 0,
                                                    decoder["head_size"]), np.float32)
            for i in range(decoder["num_hidden_layers"]) for kv in ("key", "value")}
    return {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask == 1, ids, -100), **past}


class Peft:
    def __init__(self, hf: Path, a_values: dict, args):
        import torch

        from tests.genai_models import peft_model

        torch.set_num_threads(args.threads)
        self.model = peft_model(hf, a_values, TARGETS, args.rank, 2 * args.rank)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        self.batch = None

    def feed(self, batch):
        import torch

        self.batch = {k: torch.from_numpy(batch[k]) for k in ("input_ids", "attention_mask", "labels")}

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(**self.batch).loss
        loss.backward()
        self.opt.step()
        return loss

    def loss(self, value) -> float:
        return float(value.detach())


class Ours:
    def __init__(self, model_file: Path, args):
        import onnxruntime as ort

        from gradbuilder import TrainingSession, add_lora
        from gradbuilder.training.lora import for_training

        self.lora = add_lora(model_file, TARGETS, args.rank, 2 * args.rank)
        params, loaded = for_training(self.lora)
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        so.log_severity_level = 3
        self.session = TrainingSession(loaded, params, sess_options=so, providers=["CPUExecutionProvider"])
        self.session.set_learning_rate(1e-4)
        self.batch = None

    def a_values(self) -> dict:
        from onnx import numpy_helper

        return {t.name: numpy_helper.to_array(t) for t in self.lora.skeleton.graph.initializer if "lora_A" in t.name}

    def feed(self, batch):
        self.batch = batch

    def step(self):
        return self.session.run(["loss"], self.batch)[0]

    def loss(self, value) -> float:
        return float(value)


def _folders(args, directory: Path):
    from tests.genai_models import genai_folder, hf_folder

    sizes = _sizes(args)
    return (hf_folder(directory, "llama", **sizes), genai_folder(directory, "llama", "fp32", **sizes),
            genai_folder(directory, "llama", "int4", **sizes))


def _contender(name: str, args, hf, fp32, int4, a_values: dict):
    if name == "gradbuilder fp32":
        return Ours(fp32 / "model.onnx", args)
    if name == "gradbuilder int4":
        return Ours(int4 / "model.onnx", args)
    return Peft(hf, a_values, args)


def _child(args) -> None:
    """One contender's peak memory over the resident set before its model is loaded."""
    import onnxruntime  # noqa: F401  (every child imports the same libraries before the baseline)
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import gradbuilder.runtime.session  # noqa: F401
    from gradbuilder.testing.memory import reset_peak, resident_bytes

    directory = Path(args.dir)
    hf, fp32, int4 = _folders(args, directory)
    config = json.loads((fp32 / "genai_config.json").read_text())
    a_values = dict(np.load(directory / "a.npz"))  # the ONNX model's initial A, saved by the parent
    reset_peak()
    base = resident_bytes("VmRSS")
    c = _contender(args.child, args, hf, fp32, int4, a_values)
    c.feed(_batch(args, config))
    for _ in range(args.warmup + 3):
        c.loss(c.step())
    print(json.dumps({"peak_mib": (resident_bytes("VmHWM") - base) / 2**20}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    ap.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = "cpu"
    if args.child:
        return _child(args)

    import benchlib
    import benchmodels

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        hf, fp32, int4 = _folders(args, directory)
        config = json.loads((fp32 / "genai_config.json").read_text())
        batch = _batch(args, config)
        ours = {"gradbuilder fp32": Ours(fp32 / "model.onnx", args), "gradbuilder int4": Ours(int4 / "model.onnx", args)}
        a_values = ours["gradbuilder fp32"].a_values()
        np.savez(directory / "a.npz", **a_values)
        contenders = {"pytorch+peft": Peft(hf, a_values, args), **ours}
        for c in contenders.values():
            c.feed(batch)
        print(f"before: {benchlib.pressure_line()}")
        times, losses, _ = benchmodels.run_interleaved(contenders, args)
        print(f"after:  {benchlib.pressure_line()}")
        memory = {}
        if not args.no_memory:
            for name in CONTENDERS:
                run = subprocess.run([sys.executable, __file__, "--child", name, "--dir", tmp,
                                      *sum(([f"--{k}", str(getattr(args, k))] for k in
                                            ("hidden", "layers", "vocab", "seq", "batch", "rank", "warmup", "threads")), [])],
                                     capture_output=True, text=True, timeout=1800)
                if run.returncode != 0:
                    raise SystemExit(f"{name}: {run.stderr[-2000:]}")
                memory[name] = json.loads(run.stdout.strip().splitlines()[-1])["peak_mib"]
            print(f"after memory: {benchlib.pressure_line()}")
        sizes = {p: sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model.onnx")) / 2**20
                 for p, folder in (("fp32", fp32), ("int4", int4))}
    base_ms = benchmodels.median_ms(times["pytorch+peft"], args.warmup)
    rel, _, _ = benchmodels.loss_rel_diff(losses["pytorch+peft"], losses["gradbuilder fp32"], 1e-3)
    print(f"Llama {args.hidden} wide, {args.layers} layers, vocab {args.vocab}; model files fp32 {sizes['fp32']:.0f} MiB, "
          f"int4 {sizes['int4']:.0f} MiB; seq {args.seq}, batch {args.batch}, rank {args.rank}, {args.threads} threads")
    print(f"{'contender':18} {'step ms':>8} {'ratio':>6} {'peak MiB':>9} {'ratio':>6}")
    figures = {}
    for name in CONTENDERS:
        ms = benchmodels.median_ms(times[name], args.warmup)
        mem = memory.get(name)
        ratio_mem = mem / memory["pytorch+peft"] if mem is not None else None
        figures[name] = {"step_ms": ms, "ratio": ms / base_ms, "peak_mib": mem, "memory_ratio": ratio_mem}
        print(f"{name:18} {ms:8.1f} {ms / base_ms:6.2f} " + (f"{mem:9.0f} {ratio_mem:6.2f}" if mem is not None else ""))
    print(f"loss, fp32 against pytorch+peft over every step: max relative difference {rel:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "figures": figures, "loss_rel": rel}, indent=1))


if __name__ == "__main__":
    main()
