"""The compiler: a forward ONNX model in, its gradient graph out.

- ``modelio``: reading models (bytes, paths, protos, graphsurgeon graphs, external data) and
  writing them (weight-free skeletons, atomic saves, the checker);
- ``registry``: the per-op gradient rules' registry and the ``Emitter`` they build nodes with
  (the rules themselves live in ``gradbuilder.rules``, one module per op family);
- ``autodiff``: the reverse walk that calls the rules;
- ``pipeline``: the one pipeline every build runs (load, the PREPARE passes, the walk, the
  FINISH passes), with its pass interface and context;
- ``passes``: the passes, one module each;
- ``builder``: ``GradientGraphBuilder``; ``split``: forward and backward graphs for a loss
  computed elsewhere (ORTModule).

It imports nothing from the training graph, the runtime or the front ends.
"""
