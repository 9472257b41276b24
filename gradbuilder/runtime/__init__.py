"""The runtime: training on stock onnxruntime.

- ``providers``: execution providers, their options, the session cache;
- ``runner``: one compiled graph, run with IOBinding (the session's and ORTModule's), and
  the thread-spinning policy of graphs that take turns;
- ``model``: the model's facts (weights, running statistics, frozen parameters, specs, the
  step's inputs and outputs, the checkpoint identity), derived once into one record;
- ``graphs``: the table of graph kinds (``Kind``) and the cache that builds and compiles
  each on first use;
- ``state``: the training state between steps, committed only after a successful run;
- ``executor``: how steps run, one interface: ``LocalExecutor`` here, the distributed ones
  (``distributed``) across processes;
- ``session``: ``TrainingSession``, a facade over the facts, graphs, state and an executor;
- ``checkpoint`` (safetensors files, and whether a session may resume one), ``schedulers`` (learning-rate schedules), ``loop``
  (the command line's training loop), ``recompute_settings`` (the session settings recompute needs).
"""
