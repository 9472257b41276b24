"""Loss scaling and half-precision moments in the training graph, against torch: the MLP of
test_optimizers trained by a plain onnxruntime loop, and by torch with ``torch.amp.GradScaler``
(whose unscale / skip / backoff / growth rules the graph follows). Batches with huge targets make
the scaled gradients overflow to inf, so steps get skipped on both sides."""

import numpy as np
import pytest
import torch

from gradbuilder.training.stages.loss_scale import GOOD_STEPS, SCALE, LossScaling

from .test_optimizers import assert_weights_match, next_state, training_run

RUNS = 12
OVERFLOW = {3, 4, 9}  # batches whose gradients overflow under the scale


def poisoned(ys):
    """``ys`` with the OVERFLOW batches' targets so large that the gradients of loss * scale
    overflow float32."""
    return [y * np.float32(1e37) if k in OVERFLOW else y for k, y in enumerate(ys)]


def torch_scaler(module, lr, init_scale, growth_interval):
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=growth_interval)
    return opt, scaler


@pytest.mark.parametrize("accumulation", [1, 2])
def test_dynamic_loss_scale_follows_torch_grad_scaler(accumulation):
    scaling = LossScaling(initial=2.0 ** 10, growth_interval=2)
    module, xs, ys, builder, sess, names, state = training_run(
        2, RUNS * accumulation, optimizer="adamw", loss_scaling=scaling, accumulation_steps=accumulation)
    ys = poisoned(ys)
    assert state[SCALE] == np.float32(2.0 ** 10) and state[GOOD_STEPS] == 0
    opt, scaler = torch_scaler(module, 0.01, 2.0 ** 10, 2)
    skipped = 0
    for k in range(RUNS * accumulation):
        before = {w: state[w] for w in builder.weights}
        feeds = {"x": xs[k], "y": ys[k], "Learning_Rate": np.array(0.01, np.float32), **state}
        got = dict(zip(names, sess.run(None, feeds)))
        state = next_state(got)
        scaler.scale(module(torch.from_numpy(xs[k]), torch.from_numpy(ys[k]))).backward()
        if (k + 1) % accumulation:
            continue
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert float(state[SCALE]) == scaler.get_scale(), k
        if any(j in OVERFLOW for j in range(k + 1 - accumulation, k + 1)):  # an inf in the summed gradients
            skipped += 1
            for w in builder.weights:  # a skipped step leaves the weights as they were
                np.testing.assert_array_equal(state[w], before[w])
    assert skipped and int(state["Step"]) == RUNS - skipped
    assert_weights_match(state, module)


def test_static_loss_scale_trains_like_no_scaling_and_skips_overflow():
    module, xs, ys, builder, sess, names, state = training_run(3, RUNS, optimizer="adamw",
                                                               loss_scaling=LossScaling(scale=1024.0))
    ys = poisoned(ys)
    assert SCALE not in state  # a static scale is a constant of the graph
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    for k in range(RUNS):
        feeds = {"x": xs[k], "y": ys[k], "Learning_Rate": np.array(0.01, np.float32), **state}
        state = next_state(dict(zip(names, sess.run(None, feeds))))
        (module(torch.from_numpy(xs[k]), torch.from_numpy(ys[k])) * 1024.0).backward()
        grads = [p.grad / 1024.0 for p in module.parameters()]
        if all(torch.isfinite(g).all() for g in grads):
            for p, g in zip(module.parameters(), grads):
                p.grad = g
            opt.step()
        opt.zero_grad()
    assert int(state["Step"]) == RUNS - len(OVERFLOW)
    assert_weights_match(state, module)


def test_fp16_moments_store_adam_state_in_float16():
    """First moments stored in float16, computed in float32 (second moments stay float32: float16
    would flush small squared gradients to zero): the weights follow float32 Adam closely."""
    module, xs, ys, builder, sess, names, state = training_run(4, RUNS, optimizer="adamw", fp16_moments=True)
    assert state["fc1.weight.exp_avg"].dtype == np.float16 and state["fc1.weight"].dtype == np.float32
    assert state["fc1.weight.exp_avg_sq"].dtype == np.float32
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    for k in range(RUNS):
        feeds = {"x": xs[k], "y": ys[k], "Learning_Rate": np.array(0.01, np.float32), **state}
        got = dict(zip(names, sess.run(None, feeds)))
        assert got["fc1.weight.exp_avg.updated"].dtype == np.float16
        state = next_state(got)
        opt.zero_grad()
        module(torch.from_numpy(xs[k]), torch.from_numpy(ys[k])).backward()
        opt.step()
    for w, p in module.named_parameters():
        ref = p.detach().numpy()
        assert np.linalg.norm(state[w] - ref) <= 2e-3 * np.linalg.norm(ref), w
        m = opt.state[p]["exp_avg"].numpy()
        np.testing.assert_allclose(state[f"{w}.exp_avg"].astype(np.float32), m, rtol=2e-2,
                                   atol=2e-3 * np.abs(m).max())
