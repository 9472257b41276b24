"""The runtime: training on stock onnxruntime.

- ``providers``: execution providers, their options, the session cache;
- ``runner``: one compiled graph, run with IOBinding (the session's and ORTModule's);
- ``graphs``: the graphs a session builds and compiles on first use;
- ``state``: the training state between steps, committed only after a successful run;
- ``session``: ``TrainingSession``, a facade over those three;
- ``checkpoint`` (safetensors files), ``schedulers`` (learning-rate schedules), ``loop``
  (the command line's training loop), ``recompute`` (the session settings recompute needs).
"""
