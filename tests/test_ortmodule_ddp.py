"""ORTModule under torch's data-parallel wrappers.

``DistributedDataParallel(ORTModule(model))`` with the gloo backend, two processes on
localhost: each rank trains on its half of a fixed global batch; DDP averages the gradients
that ORTModule's backward hands to autograd, so both ranks must end with the parameters of a
plain PyTorch run on the whole batch (mean loss). ``torch.nn.DataParallel`` is refused,
whichever way round it is wrapped.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from gradbuilder.errors import InvalidArgumentError

WORLD = 2
GLOBAL_BATCH = 8
STEPS = 3
LR = 0.1
RTOL, ATOL = 1e-5, 1e-6
JOIN_TIMEOUT_S = 120  # the whole two-process run; a hung collective fails the test instead of the suite


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def _train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, params: dict) -> dict:
    """STEPS SGD steps on (x, y) with a mean loss; the first step's gradients, the losses and the
    final parameters, by parameter name."""
    opt = torch.optim.SGD(params.values(), lr=LR)
    first_grads, losses, grad_fns = None, [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        grad_fns.append(type(out.grad_fn).__name__)
        loss = F.mse_loss(out, y)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone() for n, p in params.items()}
        losses.append(loss.item())
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in params.items()}, "grads": first_grads,
            "losses": losses, "grad_fns": grad_fns}


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: DDP(ORTModule(mlp)) on its half of the global batch; the results go to
    ``out_dir/rank<rank>.pt``."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import onnxruntime as ort

    from gradbuilder.ortmodule import ORTModule

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        inner = _mlp()
        model = torch.nn.parallel.DistributedDataParallel(ORTModule(inner, session_options=so))
        x, y = _global_batch()
        half = GLOBAL_BATCH // WORLD
        x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        result = _train(model, x, y, dict(inner.named_parameters()))
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(out_dir: str) -> None:
    """Both ranks in spawned processes; fails (and ends them) if they do not finish in time."""
    context = mp.start_processes(_ddp_worker, args=(_free_port(), out_dir), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=1):  # raises if a rank failed, with its traceback
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD} DDP ranks did not finish within {JOIN_TIMEOUT_S} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)


@pytest.mark.slow  # two processes and a full training run
def test_ddp_of_ortmodule_matches_single_process_full_batch(tmp_path):
    _run_ranks(str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    reference = _mlp()
    x, y = _global_batch()
    expected = _train(reference, x, y, dict(reference.named_parameters()))

    names = list(expected["params"])
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for r in ranks:
        # The forward ran through onnxruntime (ORTModule's autograd Function), not PyTorch.
        assert r["grad_fns"] == ["ORTFunctionBackward"] * STEPS
        assert list(r["params"]) == names and list(r["grads"]) == names
    assert expected["grad_fns"] == ["AddmmBackward0"] * STEPS

    # Both ranks hold the same averaged gradients and so the same parameters.
    for n in names:
        torch.testing.assert_close(ranks[0]["grads"][n], ranks[1]["grads"][n], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0]["params"][n], ranks[1]["params"][n], rtol=0, atol=0)

    # The average of the two half-batch mean-loss gradients is the full-batch gradient.
    for n in names:
        torch.testing.assert_close(ranks[0]["grads"][n], expected["grads"][n], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ranks[0]["params"][n], expected["params"][n], rtol=RTOL, atol=ATOL)

    # Training moved the parameters, and the full-batch loss is the mean of the halves' losses
    # at every step.
    initial = dict(_mlp().named_parameters())
    assert all(not torch.allclose(expected["params"][n], initial[n]) for n in names)
    for step in range(STEPS):
        mean = (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2
        assert mean == pytest.approx(expected["losses"][step], rel=RTOL, abs=ATOL)


_DATA_PARALLEL_MESSAGE = r"DataParallel.*DistributedDataParallel"


def test_data_parallel_around_ortmodule_is_refused():
    from gradbuilder.ortmodule import ORTModule

    model = torch.nn.DataParallel(ORTModule(_mlp()))
    with pytest.raises(InvalidArgumentError, match=_DATA_PARALLEL_MESSAGE):
        model(torch.randn(4, 8))


def test_ortmodule_around_data_parallel_is_refused():
    from gradbuilder.ortmodule import ORTModule

    with pytest.raises(InvalidArgumentError, match=_DATA_PARALLEL_MESSAGE):
        ORTModule(torch.nn.DataParallel(_mlp()))
