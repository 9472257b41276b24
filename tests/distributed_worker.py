"""One rank of a distributed test (tests/test_distributed.py starts one process per rank,
with torchrun's or mpirun's environment): trains a TrainingSession on its shard of each
micro-batch and writes what it saw to ``<out>/rank<r>.npz``.

    python tests/distributed_worker.py CONFIG.json

(or :func:`run_rank`, in a process forked from a server that imported what it needs once).

CONFIG: model (path), params (TrainingParameters.to_dict()), lr, data (npz with arrays
[steps, global batch, ...] per input), mode ("run" or "stepwise"), and optionally
"checkpoint_at" / "checkpoint" (save after that many steps), "resume" (a checkpoint to load
first), "die_at" (this rank kills itself at that step: "die_rank"), "raise_at" (the program
raises on "raise_rank"), "bad_feed_at" (this rank feeds a wrongly shaped batch at that step:
"bad_rank"), "torch_ddp" (also train torch's DDP from that state dict), "out".
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
import onnxruntime as ort

from gradbuilder import TrainingParameters, TrainingSession
from gradbuilder.runtime.distributed import launched


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank, world = launched()
    params = TrainingParameters.from_dict(cfg["params"])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = TrainingSession(cfg["model"], params, so, providers=["CPUExecutionProvider"])
    sess.set_learning_rate(cfg["lr"])
    if cfg.get("resume"):
        sess.load_checkpoint(cfg["resume"])
    data = dict(np.load(cfg["data"]))
    replicas = world // max(params.pipeline_parallel_size, 1)
    shard = rank % replicas
    losses = []
    steps = next(iter(data.values())).shape[0]
    for step in range(steps):
        feeds = {}
        for name, batches in data.items():
            part = np.array_split(batches[step], replicas)[shard]
            feeds[name] = part
        if cfg.get("die_at") == step and rank == cfg.get("die_rank"):
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.get("raise_at") == step and rank == cfg.get("raise_rank"):
            raise RuntimeError("the user's program failed on this rank")
        if cfg.get("bad_feed_at") == step and rank == cfg.get("bad_rank"):
            feeds = {n: v[:-1] for n, v in feeds.items()}
        if cfg["mode"] == "run":
            out = sess.run(None, feeds)
            losses.append(float(np.asarray(out[0])))
        else:
            sess.lazy_reset_grad()
            for micro in range(params.gradient_accumulation_steps):
                part = {n: np.array_split(v, params.gradient_accumulation_steps)[micro] for n, v in feeds.items()}
                out = sess.train_step(part)
                losses.append(float(np.asarray(out[0] if isinstance(out, list) else out)))
            sess.optimizer_step()
        if cfg.get("checkpoint_at") == step + 1:
            sess.save_checkpoint(cfg["checkpoint"])
    state = sess.get_model_state()["full_precision"]
    optimizer = sess.get_optimizer_state()
    flat = {f"w/{n}": v for n, v in state.items()}
    if cfg.get("torch_ddp"):  # the same training with torch's DistributedDataParallel, in this group
        flat.update(torch_ddp(cfg, data, rank, world))
    flat.update({f"o/{w}/{s}": v for w, states in optimizer.items() for s, v in states.items()})
    np.savez(os.path.join(cfg["out"], f"rank{rank}.npz"), losses=np.array(losses), **flat)
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"partition": sess.get_partition_info_map(), "step": sess.step}, f)


def torch_ddp(cfg: dict, data: dict, rank: int, world: int) -> dict:
    """DistributedDataParallel (broadcast_buffers) over tests/test_running_stats.CNN from the
    state dict ``cfg["torch_ddp"]``, SGD with the session's learning rate, on the same shards:
    {"t/losses": ..., "t/<name>": parameter or buffer}."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.test_running_stats import CNN

    module = CNN()
    module.load_state_dict(torch.load(cfg["torch_ddp"]))
    ddp = DistributedDataParallel(module, broadcast_buffers=True)
    opt = torch.optim.SGD(module.parameters(), lr=cfg["lr"])
    losses = []
    for step in range(next(iter(data.values())).shape[0]):
        x, y = (torch.from_numpy(np.array_split(data[n][step], world)[rank]) for n in ("x", "y"))
        opt.zero_grad()
        loss, _ = ddp(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {f"t/{n}": v.detach().numpy() for n, v in module.state_dict().items()}
    out["t/losses"] = np.array(losses)
    return out


def run_rank(config: str, env: dict, stderr_path: str) -> None:
    """One rank in a process forked from the tests' fork server, which has imported torch,
    onnxruntime and gradbuilder once (a fresh interpreter per rank spends seconds importing
    them): the rank's environment, its stderr to a file, then :func:`main` as on the command line."""
    os.environ.update(env)
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # OpenMP read its variables at import
    sys.argv = [__file__, config]
    try:
        main()
    except Exception:  # uncaught, as the interpreter ends a program: sys.excepthook, then exit code 1
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
