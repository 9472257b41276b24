"""LoRA on ONNX decoders (gradbuilder.training.lora, `gradbuilder lora`): the branches compute
what PEFT's do, the adapter file is the one onnxruntime and onnxruntime-genai load, the merged
model equals the adapted one, and bad input is a one-line error before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder.errors import InvalidArgumentError
from gradbuilder.training.lora import add_lora, for_training, lora_layout, lora_parameters, merge_lora, write_adapter
from gradbuilder.training.loss import append_loss

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("tokenizers")

from .genai_models import genai_folder  # noqa: E402

CPU = ["CPUExecutionProvider"]
pytestmark = pytest.mark.filterwarnings("ignore:.*appears in graph inputs")


def _quiet():
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return so


def _run(model, feeds, outputs=("logits",), run_options=None):
    data = model.to_bytes() if hasattr(model, "to_bytes") else (
        model.SerializeToString() if isinstance(model, onnx.ModelProto) else model)
    sess = ort.InferenceSession(data, _quiet(), providers=CPU)
    return sess.run(list(outputs), feeds, run_options)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tmp_path_factory.mktemp("genai")


def _feeds(folder: Path, batch=2, seq=7, seed=0):
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 200, (batch, seq)).astype(np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[1:, seq - 2:] = 0  # right padding
    feeds = {"input_ids": ids, "attention_mask": mask}
    for layer in range(config["num_hidden_layers"]):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kv}"] = np.zeros(
                (batch, config["num_key_value_heads"], 0, config["head_size"]), np.float32)
    return feeds


# ------------------------------------------------------------------ the branches


def _linear(op="MatMul", trans_b=0, k=6, n=5, opset=18):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    attrs = {"transB": trans_b} if op == "Gemm" else {}
    node = helper.make_node(op, ["x", "blk.q_proj.weight"], ["y"], name="blk/q_proj/" + op, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
                              [numpy_helper.from_array(w, "blk.q_proj.weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), w


@pytest.mark.parametrize("op,trans_b", [("MatMul", 0), ("Gemm", 0), ("Gemm", 1)])
def test_a_branch_adds_x_a_b_times_alpha_over_r_and_starts_as_the_base(op, trans_b):
    model, w = _linear(op, trans_b)
    lora = add_lora(model, "q_proj", rank=2, alpha=6)
    x = np.random.default_rng(2).standard_normal((3, 6)).astype(np.float32)
    base = w.T if trans_b else w
    np.testing.assert_allclose(_run(lora, {"x": x}, ["y"])[0], x @ base, rtol=1e-6)  # B starts at zero
    a_name, b_name = lora_parameters(lora)
    a = numpy_helper.to_array(next(t for t in lora.skeleton.graph.initializer if t.name == a_name))
    assert a.shape == (6, 2) and np.abs(a).max() <= 1 / np.sqrt(6)  # PEFT's kaiming_uniform(a=sqrt 5) bound
    b = np.random.default_rng(3).standard_normal((2, 5)).astype(np.float32)
    got = _run(lora, {"x": x, a_name: a, b_name: b}, ["y"])[0]
    np.testing.assert_allclose(got, x @ base + (x @ a) @ b * 3.0, rtol=1e-5, atol=1e-6)
    merged = merge_lora(lora, {a_name: a, b_name: b})
    assert not lora_parameters_in(merged) and [i.name for i in merged.skeleton.graph.input] == ["x"]
    np.testing.assert_allclose(_run(merged, {"x": x}, ["y"])[0], got, rtol=1e-5, atol=1e-6)


def lora_parameters_in(model) -> list[str]:
    return [i.name for i in model.skeleton.graph.input if ".lora_" in i.name]


def test_the_fused_qkv_projection_is_split_per_target(folders):
    folder = genai_folder(folders, "llama")
    lora = add_lora(folder / "model.onnx", ["q_proj", "v_proj"], rank=4, alpha=8)
    layout = lora_layout(lora)
    assert layout["scale"] == 2.0
    first = [b for b in layout["branches"] if ".layers.0." in b["weight"]]
    # 4 query heads and 2 key/value heads of 16: q is columns 0..64, k 64..96, v 96..128
    assert [(b["target"], b["start"], b["width"]) for b in first] == [("q_proj", 0, 64), ("v_proj", 96, 32)]
    assert first[0]["a"] == "model.layers.0.attn.q_proj.lora_A.weight"
    feeds = _feeds(folder)
    base = _run(onnx.load(folder / "model.onnx"), feeds)[0]
    np.testing.assert_array_equal(_run(lora, feeds)[0], base)  # B = 0: the base model exactly
    # a B on the v columns only leaves the query and key columns alone, and moves the logits
    values = {n: np.zeros(_shape(lora, n), np.float32) for n in lora_parameters(lora)}
    values.update({n: _init(lora, n) for n in values if "lora_A" in n})
    values["model.layers.0.attn.v_proj.lora_B.weight"] = np.full((4, 32), 0.5, np.float32)
    moved = _run(lora, {**feeds, **values})[0]
    assert np.abs(moved - base).max() > 1e-3
    merged = merge_lora(lora, values)
    np.testing.assert_allclose(_run(merged, feeds)[0], moved, rtol=1e-4, atol=1e-5)


def _shape(model, name):
    return tuple(next(t for t in model.skeleton.graph.initializer if t.name == name).dims)


def _init(model, name):
    return numpy_helper.to_array(next(t for t in model.skeleton.graph.initializer if t.name == name))


def test_the_adapter_file_is_the_one_onnxruntime_applies(folders, tmp_path):
    folder = genai_folder(folders, "llama")
    lora = add_lora(folder / "model.onnx", "q_proj,v_proj,o_proj", rank=2, alpha=4)
    rng = np.random.default_rng(4)
    values = {n: rng.standard_normal(_shape(lora, n)).astype(np.float32) * 0.1 for n in lora_parameters(lora)}
    path = write_adapter(tmp_path / "a.onnx_adapter", values)
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    feeds = _feeds(folder)
    np.testing.assert_array_equal(_run(lora, feeds, run_options=options)[0], _run(lora, {**feeds, **values})[0])


def test_lora_errors_name_what_is_wrong(folders):
    folder = genai_folder(folders, "llama")
    with pytest.raises(InvalidArgumentError, match=r"no MatMul, Gemm or MatMulNBits weight matches \['qproj'\]; "
                                                   r"the model's projections are .*'o_proj'"):
        add_lora(folder / "model.onnx", "qproj")
    with pytest.raises(InvalidArgumentError, match="rank must be an int >= 1, got 0"):
        add_lora(folder / "model.onnx", "q_proj", rank=0)
    with pytest.raises(InvalidArgumentError, match="has LoRA branches already"):
        add_lora(add_lora(folder / "model.onnx", "q_proj"), "v_proj")


# ------------------------------------------------------------------ the loss


def test_the_causal_lm_loss_is_transformers_shifted_cross_entropy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((2, 5, 11)).astype(np.float32)
    labels = rng.integers(0, 11, (2, 5)).astype(np.int64)
    labels[1, 3:] = -100  # padding
    labels[0, :2] = -100  # a prompt
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 11])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 11])])
    model = append_loss(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), "causal_lm", "logits",
                        target_name="labels")
    got = _run(model.SerializeToString(), {"x": logits, "labels": labels}, ["loss"])[0]
    t = torch.from_numpy(logits)
    want = torch.nn.functional.cross_entropy(t[:, :-1].reshape(-1, 11), torch.from_numpy(labels)[:, 1:].reshape(-1),
                                             ignore_index=-100)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


# ------------------------------------------------------------------ against PyTorch + PEFT


def _peft_twin(folder_root, arch, lora, targets, rank, alpha):
    """PyTorch + PEFT on the checkpoint the ONNX model was built from, with its initial A."""
    pytest.importorskip("peft")
    from .genai_models import hf_folder, peft_model

    a_values = {n: _init(lora, n) for n in lora_parameters(lora) if ".lora_A." in n}
    return peft_model(hf_folder(folder_root, arch), a_values, targets, rank, alpha, attn_implementation="eager")


def _pairs(model):
    """{ONNX LoRA input: the PEFT parameter holding it (transposed)}."""
    from .genai_models import onnx_lora_name

    return {onnx_lora_name(name): p for name, p in model.named_parameters() if ".lora_" in name}


def _batch(folder: Path):
    feeds = _feeds(folder, batch=2, seq=9, seed=7)
    labels = np.where(feeds["attention_mask"] == 1, feeds["input_ids"], -100)
    return feeds, labels


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_gradients_and_steps_equal_pytorch_and_peft(folders, arch):
    """SGD with lr 1 (the update is the gradient) for the gradients, then AdamW steps: losses
    and adapters against PEFT on the same float32 weights, initialisation and batch."""
    torch = pytest.importorskip("torch")
    from gradbuilder import TrainingSession

    folder = genai_folder(folders, arch)
    targets, rank, alpha = ("q_proj", "v_proj"), 4, 8
    lora = add_lora(folder / "model.onnx", targets, rank, alpha)
    feeds, labels = _batch(folder)
    for optimizer, lr, steps in (("sgd", 1.0, 1), ("adamw", 1e-2, 3)):
        twin = _peft_twin(folders, arch, lora, targets, rank, alpha)
        pairs = _pairs(twin)
        params, loaded = for_training(lora, optimizer)
        session = TrainingSession(loaded, params, providers=CPU)
        session.set_learning_rate(lr)
        opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW)(list(pairs.values()), lr=lr)
        for _ in range(steps):
            (ours,) = session.run(["loss"], {**feeds, "labels": labels})
            out = twin(input_ids=torch.from_numpy(feeds["input_ids"]),
                       attention_mask=torch.from_numpy(feeds["attention_mask"]), labels=torch.from_numpy(labels))
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            np.testing.assert_allclose(ours, out.loss.item(), rtol=2e-5)
        state = session.get_model_state()["full_precision"]
        for name, p in pairs.items():  # each tensor against its own largest entry (B: the gradient, after SGD)
            want = p.detach().numpy().T
            worst, largest = np.abs(state[name] - want).max(), np.abs(want).max()
            assert largest > 0 and worst <= 1e-4 * largest, f"{optimizer} {name}: {worst:.2e} off (largest {largest:.2e})"


# ------------------------------------------------------------------ the command, end to end


def _generate(folder: Path, prefix_ids: list[int], length: int, adapter: Path | None) -> list[int]:
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prefix_ids) + length, do_sample=False)
    generator = og.Generator(model, params)
    if adapter is not None:
        adapters = og.Adapters(model)
        adapters.load(str(adapter), "memorized")
        generator.set_active_adapter(adapters, "memorized")
    generator.append_tokens(np.array(prefix_ids, np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return list(generator.get_sequence(0))


@pytest.mark.parametrize("arch,precision", [
    ("llama", "fp32"), ("llama", "int4"),
    *[pytest.param(a, p, marks=pytest.mark.slow) for a in ("qwen2", "phi3", "gemma") for p in ("fp32", "int4")]])
def test_an_adapter_trained_by_the_command_makes_genai_generate_the_text(folders, tmp_path, arch, precision):
    from tokenizers import Tokenizer

    from .genai_models import TEXT

    folder = genai_folder(folders, arch, precision)
    before = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": TEXT}) + "\n")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "gradbuilder.cli", "lora", str(folder), "--data", str(data),
                          "--output-dir", str(out), "--targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                          "--rank", "8", "--alpha", "16", "--steps", "60", "--lr", "1e-2", "--batch-size", "1"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == before  # the model folder untouched
    assert (out / "adapter.onnx_adapter").is_file() and (out / "genai_config.json").is_file()
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids
    prefix, rest = ids[:4], ids[4:]
    with_adapter = _generate(out, prefix, len(rest), out / "adapter.onnx_adapter")
    without = _generate(out, prefix, len(rest), None)
    assert with_adapter[len(prefix):len(ids)] == rest
    assert without[len(prefix):len(ids)] != rest


def _mlp(directory: Path) -> Path:
    model, _ = _linear()
    onnx.save(model, directory / "mlp.onnx")
    return directory / "mlp.onnx"


def _lora_cli(*argv):
    return subprocess.run([sys.executable, "-m", "gradbuilder.cli", "lora", *map(str, argv)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case,fragment", [
    ("target", "targets: no MatMul, Gemm or MatMulNBits weight matches ['qq_proj']"),
    ("rank", "--rank: "),
    ("text", "line 2: no text"),
    ("folder", "has no genai_config.json"),
    ("decoder", "is not a decoder: it needs an input 'input_ids'"),
    ("inside", "is in the model's folder"),
    ("merge-int4", "--merge: the model's weights are quantized (MatMulNBits)"),
])
def test_bad_input_is_one_line_before_any_training(folders, tmp_path, case, fragment):
    folder = genai_folder(folders, "llama")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hi there"}) + "\n" + json.dumps({"txt": "oops"} if case == "text"
                                                                        else {"text": "ok"}) + "\n")
    args = {"target": [folder, "--data", data, "--output-dir", tmp_path / "o", "--targets", "qq_proj"],
            "rank": [folder, "--data", data, "--output-dir", tmp_path / "o", "--rank", "0"],
            "text": [folder, "--data", data, "--output-dir", tmp_path / "o"],
            "folder": [tmp_path, "--data", data, "--output-dir", tmp_path / "o"],
            "decoder": [_mlp(tmp_path), "--tokenizer", folder / "tokenizer.json", "--data", data,
                        "--output-dir", tmp_path / "o"],
            "inside": [folder, "--data", data, "--output-dir", folder / "out"],
            "merge-int4": [genai_folder(folders, "llama", "int4"), "--data", data, "--output-dir", tmp_path / "o",
                           "--merge"]}[case]
    run = _lora_cli(*args)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], run.stderr
    assert not (tmp_path / "o").exists() and not (folder / "out").exists()


# ------------------------------------------------------------------ in JavaScript


def test_node_trains_the_same_adapter_as_python(folders, tmp_path):
    """export_web's artifacts of the LoRA model, trained by gradbuilder-train.mjs's Trainer on
    onnxruntime-node (tests/web/lora_train.mjs), give the losses and adapter that
    `gradbuilder lora`'s TrainingSession gives on the same initial state and batches: int64
    tokens, labels, and the zero-length past inputs fed as they are."""
    from safetensors.numpy import load_file

    from gradbuilder import TrainingSession
    from gradbuilder.training.web import export_web, safetensors_bytes

    from .test_web import ROOT, need_node

    need_node()
    steps, lr = 5, 1e-2
    folder = genai_folder(folders, "llama")
    lora = add_lora(folder / "model.onnx", "q_proj,v_proj", rank=4, alpha=8)
    names = lora_parameters(lora)
    batches = []
    for i in range(steps):
        feeds = _feeds(folder, batch=2, seq=9, seed=10 + i)
        batches.append({**feeds, "labels": np.where(feeds["attention_mask"] == 1, feeds["input_ids"], -100)})
    # each input with a leading step axis; the past inputs [steps, 2, 2, 0, 16] hold no bytes
    (tmp_path / "batches.safetensors").write_bytes(
        safetensors_bytes({k: np.stack([b[k] for b in batches]) for k in batches[0]}))
    web = tmp_path / "web"
    # the training of `gradbuilder lora`: AdamW, the gradients clipped to a global norm of 1
    export_web(lora, web, loss="causal_lm", loss_output="logits", target_name="labels", requires_grad=names,
               optimizer="adamw", lr=lr, max_grad_norm=1.0)
    run = subprocess.run(["node", str(ROOT / "tests" / "web" / "lora_train.mjs"), str(web),
                          str(tmp_path / "batches.safetensors"), str(tmp_path / "trained.safetensors"),
                          str(tmp_path / "losses.json"), "--threads", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    node = json.loads((tmp_path / "losses.json").read_text())
    assert node["step"] == steps and node["skipped"] == 0

    params, loaded = for_training(lora)
    so = _quiet()
    so.intra_op_num_threads = 1
    session = TrainingSession(loaded, params, so, providers=CPU)
    session.set_learning_rate(lr)
    losses = [float(session.run(["loss"], b)[0]) for b in batches]
    np.testing.assert_allclose(node["losses"], losses, rtol=1e-5)
    state = session.get_model_state()["full_precision"]
    trained = load_file(tmp_path / "trained.safetensors")
    initial = load_file(web / "state.safetensors")
    for name in names:
        want, got = state[name], trained[name]
        worst, largest = np.abs(got - want).max(), np.abs(want).max()
        assert largest > 0 and worst <= 1e-4 * largest, f"{name}: {worst:.2e} off (largest {largest:.2e})"
        assert np.abs(want - initial[name]).max() > 1e-3  # trained: every tensor moved
    for w, moments in session.get_optimizer_state().items():
        for s, v in moments.items():
            if w != "shared_optimizer_state":
                np.testing.assert_allclose(trained[f"{w}.{s}"], v, rtol=1e-4, atol=1e-9, err_msg=f"{w}.{s}")
    # the model the Trainer exports for inference computes the base with Python's adapter
    feeds = _feeds(folder, seed=3)
    np.testing.assert_allclose(_run(str(web / "trained" / "inference_model.onnx"), feeds)[0],
                               _run(lora, {**feeds, **{n: state[n] for n in names}})[0], rtol=1e-4, atol=1e-5)


def test_the_lora_model_makes_training_artifacts_like_any_model(folders, tmp_path):
    """generate_artifacts of add_lora's model: the LoRA inputs are the only weights, and the
    training model the artifacts describe runs on stock onnxruntime and moves them."""
    from safetensors.numpy import load_file

    from gradbuilder import generate_artifacts

    folder = genai_folder(folders, "llama", "int4")
    lora = add_lora(folder / "model.onnx", "q_proj,v_proj", rank=2, alpha=4)
    names = lora_parameters(lora)
    paths = generate_artifacts(lora, requires_grad=names, loss="causal_lm", loss_output="logits",
                               target_name="labels", optimizer="sgd", artifact_directory=tmp_path / "art")
    checkpoint = load_file(paths["checkpoint.safetensors"])
    assert sorted(n for n in checkpoint if n != "Step") == sorted(names)
    training = ort.InferenceSession(paths["training_model.onnx"], _quiet(), providers=CPU)
    feeds, labels = _batch(folder)
    grads = dict(zip([o.name for o in training.get_outputs()],
                     training.run(None, {**feeds, "labels": labels, **{n: checkpoint[n] for n in names}})))
    b_grads = [grads[f"{n}_grad"] for n in names if "lora_B" in n]
    assert b_grads and all(np.abs(g).max() > 0 for g in b_grads)  # B starts at zero; its gradient does not
