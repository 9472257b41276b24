"""`gradbuilder lora`: train a LoRA adapter on an ONNX decoder (an onnxruntime-genai model
folder, or a plain .onnx with --tokenizer), on the ONNX model itself: no PyTorch, no original
checkpoint, an int4 base kept int4.

The data is JSON lines, each ``{"text": ...}`` (every token scored) or ``{"prompt": ...,
"completion": ...}`` (the completion's tokens only), tokenized with the folder's
``tokenizer.json`` (the ``tokenizers`` library), the end-of-sequence token appended, cut at
--max-length, padded on the right. OUT receives the transformed model (the base with LoRA
inputs, which onnxruntime-genai loads with or without the adapter), the folder's config and
tokenizer files, and ``adapter.onnx_adapter``; with --merge also ``merged/`` (float bases).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

from ..errors import InvalidArgumentError
from .common import check_input_file, common_options, integer, listed, positive_float, progress

log = logging.getLogger("gradbuilder")

ADAPTER = "adapter.onnx_adapter"
IGNORED = -100  # the label of a token the loss does not score


def add_lora(sub) -> None:
    p = sub.add_parser("lora", help="train a LoRA adapter on an ONNX decoder (an onnxruntime-genai model folder)")
    p.add_argument("model", help="an onnxruntime-genai model folder (genai_config.json, tokenizer.json, the model), "
                                 "or a decoder .onnx with --tokenizer")
    p.add_argument("--data", required=True, help='JSON lines: {"text": ...} or {"prompt": ..., "completion": ...}')
    p.add_argument("--output-dir", required=True, help="where the transformed model, its config and tokenizer "
                                                       f"and {ADAPTER} are written (made if missing)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the model folder's)")
    p.add_argument("--targets", default="q_proj,v_proj",
                   help="the projections to adapt, comma-separated, as PEFT's target_modules (default q_proj,v_proj)")
    p.add_argument("--rank", type=integer(1), default=8, help="LoRA rank r (default 8)")
    p.add_argument("--alpha", type=positive_float, default=16.0, help="LoRA alpha: the branch is scaled by alpha/r "
                                                                      "(default 16)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=integer(1), help="optimizer steps")
    length.add_argument("--epochs", type=integer(1), help="passes over the data (default 1)")
    p.add_argument("--lr", type=positive_float, default=2e-4, help="AdamW learning rate (default 2e-4)")
    p.add_argument("--batch-size", type=integer(1), default=4, help="sequences per step (default 4)")
    p.add_argument("--max-length", type=integer(2), default=256, help="tokens per sequence at most (default 256)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the A matrices and the data order")
    p.add_argument("--merge", action="store_true", help="also write merged/: the adapter folded into a float base")
    common_options(p, progress=True)
    p.set_defaults(fn=_cmd_lora)


def _cmd_lora(args) -> int:
    folder, model_file, tokenizer_file, config = _model_files(args)
    out = _check_output(args, folder, model_file)
    rows = _read_data(args.data)
    import numpy as np

    from ..compiler import modelio

    base = modelio.load_proto(str(model_file), external=False)  # names only
    _check_decoder(base, model_file)
    if args.merge:
        _check_mergeable(base)
    del base

    try:
        from tokenizers import Tokenizer
    except ImportError:
        from ..errors import MissingDependencyError

        raise MissingDependencyError("gradbuilder lora reads tokenizer.json with the tokenizers library: "
                                     "pip install 'gradbuilder[lora]'") from None

    from ..runtime.loop import fit
    from ..runtime.session import TrainingSession
    from ..training.lora import add_lora, for_training

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    data = _tokenized(rows, tokenizer, args.max_length, config)
    lora = add_lora(model_file, args.targets, args.rank, args.alpha, seed=args.seed)
    data.update(_empty_past(lora.skeleton, config, len(data["input_ids"])))
    params, loaded = for_training(lora)
    steps = args.steps or math.ceil(len(data["input_ids"]) / args.batch_size) * (args.epochs or 1)
    session = TrainingSession(loaded, params, providers=["CPUExecutionProvider"])
    del loaded
    session.set_learning_rate(args.lr)
    log.info("training a rank-%d LoRA adapter (%s values) on %s: %d sequences, %d steps of %d", args.rank,
             f"{session.get_parameters_size():,}", model_file.name, len(data["input_ids"]), steps, args.batch_size)
    losses = fit(session, data, steps, args.batch_size, seed=args.seed, progress=progress(args),
                 tokens="attention_mask")
    values = session.get_model_state()["full_precision"]
    _write(out, folder, model_file, lora, values, args.merge)
    log.info("loss %.4f -> %.4f; wrote %s", losses[0], float(np.mean(losses[-max(1, len(losses) // 10):])), out)
    print(f"wrote {out / ADAPTER} and the model it adapts ({out / model_file.name})")
    return 0


# ------------------------------------------------------------------ checks, before any work


def _model_files(args):
    """(the model folder or None, the .onnx, tokenizer.json, genai_config.json's dict or {})."""
    path = Path(args.model)
    if path.is_dir():
        config_file = path / "genai_config.json"
        if not config_file.is_file():
            raise InvalidArgumentError(f"model folder '{path}' has no genai_config.json: give an onnxruntime-genai "
                                       "model folder, or a decoder .onnx with --tokenizer")
        try:
            config = json.loads(config_file.read_text())
            name = config["model"]["decoder"]["filename"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"'{config_file}' is not an onnxruntime-genai config (model.decoder.filename: "
                                       f"{exc})") from None
        model_file = path / name
        check_input_file("model", str(model_file))
        tokenizer = Path(args.tokenizer) if args.tokenizer else path / "tokenizer.json"
        check_input_file("--tokenizer", str(tokenizer))
        return path, model_file, tokenizer, config
    check_input_file("model", str(path))
    tokenizer = Path(args.tokenizer) if args.tokenizer else path.parent / "tokenizer.json"
    if not tokenizer.is_file():
        raise InvalidArgumentError(f"model '{path}' is a file: name its tokenizer with --tokenizer tokenizer.json")
    return None, path, tokenizer, {}


def _check_output(args, folder, model_file) -> Path:
    from .. import files

    out = files.check_output_directory(args.output_dir, InvalidArgumentError, "--output-dir").resolve()
    if folder is not None and (out == folder.resolve() or folder.resolve() in out.parents):
        raise InvalidArgumentError(f"--output-dir '{args.output_dir}' is in the model's folder; nothing in it is "
                                   "changed: choose another directory")
    if folder is None and out == model_file.parent.resolve():
        raise InvalidArgumentError(f"--output-dir '{args.output_dir}' holds the model, which would be written over: "
                                   "choose another directory")
    return out


def _read_data(path: str) -> list[dict]:
    """The JSON lines of ``path``, each checked: text, or prompt and completion (strings)."""
    check_input_file("--data", path)
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise InvalidArgumentError(f"--data {path} line {number}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise InvalidArgumentError(f"--data {path} line {number}: a JSON object is needed, e.g. "
                                           '{"text": "..."}')
            if isinstance(row.get("text"), str) and row["text"]:
                rows.append({"text": row["text"]})
            elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str) and row["completion"]:
                rows.append({"prompt": row["prompt"], "completion": row["completion"]})
            else:
                raise InvalidArgumentError(f"--data {path} line {number}: no text: give \"text\" (a non-empty "
                                           f"string) or \"prompt\" and \"completion\"; it has {listed(sorted(row))}")
    if not rows:
        raise InvalidArgumentError(f"--data {path} holds no examples")
    return rows


def _check_decoder(proto, model_file: Path) -> None:
    inputs = {i.name for i in proto.graph.input}
    outputs = {o.name for o in proto.graph.output}
    if "input_ids" not in inputs or "logits" not in outputs:
        raise InvalidArgumentError(f"model '{model_file}' is not a decoder: it needs an input 'input_ids' and an output "
                                   f"'logits' (it has inputs {listed(sorted(inputs))}, outputs {listed(sorted(outputs))})")


def _check_mergeable(proto) -> None:
    if any(n.op_type == "MatMulNBits" for n in proto.graph.node):
        raise InvalidArgumentError("--merge: the model's weights are quantized (MatMulNBits); folding the adapter into "
                                   "4-bit weights would round most of it away. Keep the adapter, or train on the "
                                   "float model to merge")


# ------------------------------------------------------------------ the data


def _tokenized(rows: list[dict], tokenizer, max_length: int, config: dict) -> dict:
    """input_ids, attention_mask and labels [N, L] (L: the longest sequence, at most
    ``max_length``), padded on the right; labels -100 where the loss does not score."""
    import numpy as np

    section = config.get("model", {})
    eos = section.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    pad = section.get("pad_token_id", eos if eos is not None else 0)
    pad = pad[0] if isinstance(pad, list) else pad
    sequences = []
    for row in rows:
        if "text" in row:
            ids = tokenizer.encode(row["text"]).ids
            scored = [True] * len(ids)
        else:
            prompt = tokenizer.encode(row["prompt"]).ids
            completion = tokenizer.encode(row["completion"], add_special_tokens=False).ids
            ids, scored = prompt + completion, [False] * len(prompt) + [True] * len(completion)
        if eos is not None:
            ids, scored = ids + [eos], scored + [True]
        sequences.append((ids[:max_length], scored[:max_length]))
    length = max(len(ids) for ids, _ in sequences)
    data = {"input_ids": np.full((len(rows), length), pad, np.int64),
            "attention_mask": np.zeros((len(rows), length), np.int64),
            "labels": np.full((len(rows), length), IGNORED, np.int64)}
    for i, (ids, scored) in enumerate(sequences):
        data["input_ids"][i, :len(ids)] = ids
        data["attention_mask"][i, :len(ids)] = 1
        data["labels"][i, :len(ids)] = np.where(scored, ids, IGNORED)
    return data


def _empty_past(proto, config: dict, rows: int) -> dict:
    """The past key/value inputs, zero-length: [rows, kv heads, 0, head size]."""
    import numpy as np
    from onnx import helper

    decoder = config.get("model", {}).get("decoder", {})
    out = {}
    for i in proto.graph.input:
        if not i.name.startswith("past_"):
            continue
        dims = i.type.tensor_type.shape.dim
        shape = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        if len(shape) == 4:
            shape[0], shape[2] = rows, 0
            shape[1] = shape[1] or decoder.get("num_key_value_heads")
            shape[3] = shape[3] or decoder.get("head_size")
        if len(shape) != 4 or None in shape:
            raise InvalidArgumentError(f"the past input '{i.name}' has no static [batch, heads, past, head_size] shape "
                                       "and the model folder's genai_config.json does not give it")
        out[i.name] = np.zeros(shape, helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
    return out


# ------------------------------------------------------------------ the outputs


def _write(out: Path, folder, model_file: Path, lora, values, merge: bool) -> None:
    """OUT: the folder's other files (config, tokenizer), the transformed model, the adapter;
    with ``merge`` also merged/: the same files and the merged model."""
    from .. import files
    from ..training.lora import lora_parameters, merge_lora, write_adapter

    adapter = {n: values[n] for n in lora_parameters(lora)}
    others = [] if folder is None else [f for f in sorted(folder.iterdir())
                                        if f.is_file() and not f.name.startswith(model_file.name)]
    with files.output_directory(out, what="--output-dir"):
        for directory in [out, out / "merged"] if merge else [out]:
            directory.mkdir(exist_ok=True)
            for f in others:
                shutil.copyfile(f, directory / f.name)
        lora.save(out / model_file.name, external_data=_external(model_file))
        write_adapter(out / ADAPTER, adapter)
        if merge:
            merge_lora(lora, adapter).save(out / "merged" / model_file.name, external_data=_external(model_file))


def _external(model_file: Path) -> bool:
    """Keep the weights in a data file beside the model where the base did."""
    return Path(str(model_file) + ".data").is_file()
