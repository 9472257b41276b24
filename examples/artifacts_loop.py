"""Train and evaluate with gradbuilder's training artifacts on stock onnxruntime only.

    gradbuilder artifacts model.onnx --loss crossentropy --optimizer adamw -o artifacts/
    python examples/artifacts_loop.py                # or, on a model of its own, as below

``generate_artifacts`` (or ``gradbuilder artifacts``) writes four files: ``training_model.onnx``
(the loss and each weight's gradient ``W_grad``; running statistics come back as
``B.updated``), ``eval_model.onnx`` (the loss in inference form), ``optimizer_model.onnx`` (one
update: every weight, its gradient and optimizer states in, ``W.updated`` ... out) and
``checkpoint.safetensors`` (the weights, running statistics, optimizer states and ``Step``). Every
parameter is a plain graph input of the models: the loop below holds them in a dict, feeds
them to each run, and takes the updated ones back. That is the whole training API.
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
from safetensors.numpy import load_file


class ArtifactsLoop:
    """A training loop over the artifacts in ``directory``: ``train_step(batch, lr)`` returns the
    loss, ``evaluate(batch)`` the eval model's outputs with the trained parameters."""

    def __init__(self, directory: str):
        load = lambda name: ort.InferenceSession(os.path.join(directory, name), providers=["CPUExecutionProvider"])  # noqa: E731
        self.training, self.eval, self.optimizer = (load(f"{k}_model.onnx") for k in ("training", "eval", "optimizer"))
        self.state = load_file(os.path.join(directory, "checkpoint.safetensors"))  # weights, statistics, states, Step
        self.weights = [i.name for i in self.optimizer.get_inputs() if i.name + "_grad" in
                        {j.name for j in self.optimizer.get_inputs()}]

    def _feeds(self, session, batch):
        wanted = {i.name for i in session.get_inputs()}
        return {**{k: v for k, v in self.state.items() if k in wanted}, **batch}

    def train_step(self, batch: dict, lr: float) -> float:
        names = [o.name for o in self.training.get_outputs()]
        out = dict(zip(names, self.training.run(None, self._feeds(self.training, batch))))
        for name, value in out.items():  # running statistics (BatchNormalization's)
            if name.endswith(".updated"):
                self.state[name[: -len(".updated")]] = value
        grads = {w + "_grad": out[w + "_grad"] for w in self.weights}
        feeds = {**self._feeds(self.optimizer, {}), **grads, "Learning_Rate": np.array(lr, np.float32)}
        names = [o.name for o in self.optimizer.get_outputs()]
        for name, value in zip(names, self.optimizer.run(None, feeds)):
            if name.endswith(".updated"):  # W, W.exp_avg, ..., Step (All_Finite: whether it applied)
                self.state[name[: -len(".updated")]] = value
        return float(out[self.training.get_outputs()[0].name])  # the loss: the first output

    def evaluate(self, batch: dict) -> dict:
        names = [o.name for o in self.eval.get_outputs()]
        return dict(zip(names, self.eval.run(None, self._feeds(self.eval, batch))))


def main() -> None:
    """A linear classifier on synthetic data: artifacts written, 200 AdamW steps, accuracy."""
    import tempfile

    from onnx import TensorProto, helper, numpy_helper

    from gradbuilder import generate_artifacts

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["logits"])], "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32) * 0.1, "W"),
         numpy_helper.from_array(np.zeros(3, np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((256, 4)).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((4, 3)), axis=1).astype(np.int64)
    with tempfile.TemporaryDirectory() as directory:
        generate_artifacts(model, loss="crossentropy", optimizer="adamw", artifact_directory=directory)
        loop = ArtifactsLoop(directory)
        for step in range(200):
            rows = slice(32 * step % 256, 32 * step % 256 + 32)
            loss = loop.train_step({"x": x[rows], "target": y[rows]}, lr=0.05)
        evaluated = loop.evaluate({"x": x, "target": y})  # the eval model with the trained weights
        accuracy = float(np.mean(np.argmax(evaluated["logits"], axis=1) == y))
        print(f"last training loss {loss:.4f}, eval loss {float(evaluated['loss']):.4f}, accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
