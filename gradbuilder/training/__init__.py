"""The training graph: the gradient graph with the stages appended that train it.

- ``params``: ``TrainingParameters`` (onnxruntime-training's options, checked);
- ``stages``: what is appended after the gradients (loss scaling, accumulation, clipping,
  the optimizers' registry);
- ``graph``: ``TrainingGraphBuilder`` (forward, backward and update in one graph), the
  step-wise API's gradient graph, the evaluation graph, the optimizer-only graph and
  ``from_parameters``;
- ``loss``: loss blocks appended to a model that has none;
- ``artifacts``: ``generate_artifacts`` and the inference export.

It builds on the compiler and imports nothing from the runtime or the front ends.
"""
