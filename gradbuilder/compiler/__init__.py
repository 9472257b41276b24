"""The compiler: a forward ONNX model in, its gradient graph out.

- ``modelio``: reading models (bytes, paths, protos, graphsurgeon graphs, external data) and
  writing them (weight-free skeletons, atomic saves, the checker);
- ``values``: reading the IR (attributes, constants, static dims); ``traversal``: walking it
  (a node's subgraphs, the outer values they capture, what a set of values reaches);
- ``registry``: the per-op gradient rules' registry (the rules themselves live in
  ``gradbuilder.rules``, one module per op family); ``emitter``: the ``Emitter`` that rules,
  passes and the loss blocks build nodes with;
- ``autodiff``: the reverse walk that calls the rules;
- ``pipeline``: the one pipeline every build runs (load, the PREPARE passes, the walk, the
  FINISH passes);
- ``passes``: the passes, one module each, and their interface (``passes.context``: ``Context``,
  ``Pass``); a pass never imports the pipeline or the builder;
- ``builder``: ``GradientGraphBuilder``; ``split``: forward and backward graphs for a loss
  computed elsewhere (ORTModule).

It imports nothing from the training graph, the runtime or the front ends.
"""
