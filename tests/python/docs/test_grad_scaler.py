"""The original's GradScaler page: scale, unscale_, step, update, the clipping
recipe, getters and setters, against unscaled training."""
import pytest
import roundpipe
import torch
from conftest import ADAM_EPS, assert_adam_weights_close, make_model, mse
from roundpipe import (
    RoundPipe,
    RoundPipeRunConfig,
)


def test_grad_scaler_matches_unscaled_training():
    torch.manual_seed(0)
    model = make_model()
    pipe = RoundPipe(model)
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-2, eps=ADAM_EPS)  # see conftest
    scaler = roundpipe.GradScaler(init_scale=1024.0)
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    for _ in range(3):
        x, y = torch.randn(6, 4), torch.randn(6, 3)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)),
                              run_config=RoundPipeRunConfig(num_microbatch=1))
        pipe.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
        scaler.update()
        ref_opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
    pipe.synchronize()
    assert scaler.get_scale() == 1024.0
    for p, q in zip(model.parameters(), ref.parameters()):
        # 3 Adam steps on gradients that differ by rounding: 3 * lr * GRAD_ERROR / ADAM_EPS = 3e-4
        assert_adam_weights_close(p, q, steps=3, lr=1e-2)


def test_grad_scaler_clipping_recipe_and_the_original_api():
    """The documented recipe: unscale_ in the step function, clip, then
    step; against plain PyTorch with the same clipping. And the rest of the
    original's GradScaler: step returns optimizer.step's result, scale takes
    a list, update(new_scale), update(is_async=False), getters and setters."""
    torch.manual_seed(0)
    model = make_model()
    pipe = RoundPipe(model)
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-2, eps=ADAM_EPS)
    scaler = roundpipe.GradScaler(init_scale=1024.0)
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    results = []

    def step_fn():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(list(pipe.optim_parameters()), 0.05)
        results.append(scaler.step(opt))
        opt.zero_grad()

    for _ in range(3):
        x, y = torch.randn(6, 4), torch.randn(6, 3)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)),
                              run_config=RoundPipeRunConfig(num_microbatch=1))
        pipe.step(step_fn, is_async=False)
        scaler.update()
        ref_opt.zero_grad()
        mse(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
        ref_opt.step()
    pipe.synchronize()
    assert results == [None, None, None]  # Adam.step() returns None
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_adam_weights_close(p, q, steps=3, lr=1e-2)

    # unscale_ twice in one step is an error naming the rule.
    errors = []

    def twice():
        try:
            scaler.unscale_(opt)
            scaler.unscale_(opt)
        except RuntimeError as e:
            errors.append(str(e))
        scaler.step(opt)

    pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)))
    pipe.step(twice, is_async=False)
    scaler.update()
    assert len(errors) == 1 and "already been called in this step" in errors[0]

    # From the main thread (the docs: "executed on the optimizer thread and
    # synchronized"): the step is the one unscale_ in the step function
    # gives, with a warning that the gradients are not visible here.
    for clip in (False, True):  # the step of `twice` above (2 microbatches, unclipped), then this one
        ref_opt.zero_grad()
        if clip:
            mse(ref(x), y).backward()
        else:
            sum(mse(ref(a), b) for a, b in zip(x.chunk(2), y.chunk(2))).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
        ref_opt.step()
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)),
                          run_config=RoundPipeRunConfig(num_microbatch=1))
    with pytest.warns(UserWarning, match="outside the step function"):
        scaler.unscale_(opt)

    def clip_then_step():
        torch.nn.utils.clip_grad_norm_(list(pipe.optim_parameters()), 0.05)
        scaler.step(opt)  # unscales first (asked for above), not twice
        opt.zero_grad()

    pipe.step(clip_then_step, is_async=False)
    scaler.update()
    pipe.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_adam_weights_close(p, q, steps=5, lr=1e-2)

    s = roundpipe.GradScaler(init_scale=8.0, growth_interval=5)
    assert s.is_enabled() and not roundpipe.GradScaler(enabled=False).is_enabled()
    a, b = s.scale([torch.tensor(1.0), torch.tensor(2.0)])
    assert (a.item(), b.item()) == (8.0, 16.0)
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(7)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 7)
    # Step 0 overflows: a synchronous update backs off at once (8 x 0.25)...
    assert s._impl.step([torch.tensor([float("inf")])], lambda: None) is False
    s.update(is_async=False)
    assert s.get_scale() == 2.0
    # ... and the async update after step 1 does not apply that finding again.
    assert s._impl.step([torch.tensor([1.0])], lambda: None) is True
    s.update()
    assert s.get_scale() == 2.0
    assert s._impl.step([torch.tensor([1.0])], lambda: None) is True
    s.update(new_scale=torch.tensor(4.0))
    # async, as the original: the new scale applies from the next update() on
    assert s.get_scale() == 2.0
    assert s._impl.step([torch.tensor([1.0])], lambda: None) is True
    s.update()
    assert s.get_scale() == 4.0
    assert s._impl.step([torch.tensor([1.0])], lambda: None) is True
    s.update(new_scale=0.5, is_async=False)  # synchronous: at once
    assert s.get_scale() == 0.5
