"""One process of an elastic training run (tests/test_faults.py starts it with torch's launcher,
``--max-restarts``): the Python API a user's script writes. The session resumes from the newest
complete checkpoint of the run if there is one (a restarted process), trains with periodic
checkpoints, and saves the end.

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 tests/elastic_worker.py CONFIG.json

CONFIG: model (path), params (TrainingParameters.to_dict()), lr, data (npz), steps, batch_size,
save_every, checkpoint (path).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnxruntime as ort

from gradbuilder import TrainingParameters, TrainingSession
from gradbuilder.runtime.loop import BATCHES_SEEN, fit
from gradbuilder.runtime.periodic import CheckpointSeries


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = TrainingSession(cfg["model"], TrainingParameters.from_dict(cfg["params"]), so,
                              providers=["CPUExecutionProvider"])
    session.set_learning_rate(cfg["lr"])
    series = CheckpointSeries(cfg["checkpoint"])
    resumed = series.resume(session)  # None on a first start
    print(f"resumed from {resumed}" if resumed else "started", file=sys.stderr, flush=True)
    data = dict(np.load(cfg["data"]))
    remaining = cfg["steps"] - int(session.properties.get(BATCHES_SEEN, 0))
    fit(session, data, remaining, cfg["batch_size"], checkpoint=cfg["checkpoint"], save_every=cfg["save_every"],
        progress=False)
    session.save_checkpoint(cfg["checkpoint"])


if __name__ == "__main__":
    main()
