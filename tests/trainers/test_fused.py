"""The fused training kernels (trainers/fused.py, agentrl/engine/csrc/cpu_train.cpp) against
autograd on the modules they replace: values and gradients equal up to float32 round-off,
routed only where the arithmetic is the Llama one, and the module's own forward elsewhere."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from agentrl.engine import kernels
from trainers import fused

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("ninja") is None,
    reason="the kernels are compiled with g++ and ninja",
)


@pytest.fixture(scope="module", autouse=True)
def module():
    mod = kernels.module()
    assert mod is not None, "the CPU kernels did not build (see the warning logged above)"
    return mod


def _unfused(model):
    plain = copy.deepcopy(model)
    for m in plain.modules():
        vars(m).pop("forward", None)
    return plain


@pytest.mark.parametrize(("rows", "width"), [(1, 16), (7, 100), (333, 64), (1000, 48)])
def test_rms_norm_matches_autograd(rows, width):
    # Widths off the 16-lane vectors reach the scalar tails; 1000 rows span several chunks of
    # the per-thread weight gradient.
    g = torch.Generator().manual_seed(rows + width)
    norm = LlamaRMSNorm(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    x = (
        torch.randn(2, rows, width, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    ).requires_grad_()
    dy = torch.randn(2, rows, width, generator=g)
    ref = copy.deepcopy(norm)
    x_ref = x.detach().clone().requires_grad_()
    want = ref(x_ref)
    want.backward(dy)
    got = fused._RMSNorm.apply(x, norm.weight, 1e-6)
    got.backward(dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The input gradient cancels terms in some elements, where two float32 computations can
    # differ by more than their own round-off suggests: both are measured against float64.
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double()
    (w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)).backward(dy.double())
    err, err_ref = (x.grad.double() - x64.grad).abs(), (x_ref.grad.double() - x64.grad).abs()
    assert err.max() <= 2 * err_ref.max() + 1e-7, (err.max(), err_ref.max())
    assert err.mean() <= 1.5 * err_ref.mean() + 1e-9, (err.mean(), err_ref.mean())
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(norm.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [5, 16, 4099])
def test_swiglu_matches_autograd(size):
    # Gates from -120 to 120 reach both ends of the vectorised exp's clamps.
    gate = torch.linspace(-120, 120, size).requires_grad_()
    up = torch.randn(size, generator=torch.Generator().manual_seed(size)).requires_grad_()
    dy = torch.randn(size)
    g_ref, u_ref = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    want = F.silu(g_ref) * u_ref
    want.backward(dy)
    got = fused._SwiGLU.apply(gate, up)
    got.backward(dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gate.grad, g_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up.grad, u_ref.grad, rtol=1e-5, atol=1e-6)


def test_a_model_trains_the_same_through_the_fused_kernels():
    from agentrl.models import load_model

    model = load_model("tiny").train()
    plain = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert fused.use_fused_kernels(model) == 2 * layers + 1 + layers  # norms + final norm + MLPs
    ids = torch.randint(
        0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0)
    )
    w = torch.randn(2, 23, model.config.vocab_size)
    for m in (model, plain):
        (m(input_ids=ids).logits * w).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        scale = float(q.grad.abs().max()) + 1e-12
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    # The kernels ran: a plain copy (instance forwards dropped) is not bit-identical.
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, _unfused(model)(input_ids=ids).logits)


def test_other_dtypes_and_modules_keep_their_own_forward():
    from agentrl.models import load_model

    model = load_model("tiny")
    ids = torch.arange(9)[None]
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    want = bf16(input_ids=ids).logits
    assert fused.use_fused_kernels(bf16) > 0
    assert torch.equal(bf16(input_ids=ids).logits, want)  # not float32: the modules' own forward

    class OnePlusRMSNorm(LlamaRMSNorm):  # Gemma-style `(1 + weight)`: other arithmetic
        def forward(self, x):
            return super().forward(x) * (1 + self.weight) / self.weight

    gelu = copy.deepcopy(model)
    gelu.model.norm = OnePlusRMSNorm(gelu.config.hidden_size)
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    routed = fused.use_fused_kernels(gelu)
    assert routed == 2 * gelu.config.num_hidden_layers  # only the layers' own norms
    assert "forward" not in vars(gelu.model.norm)
    assert all("forward" not in vars(layer.mlp) for layer in gelu.model.layers)


def test_nothing_is_routed_without_the_kernels(monkeypatch):
    from agentrl.models import load_model

    monkeypatch.setattr(kernels, "module", lambda: None)
    model = load_model("tiny")
    assert fused.use_fused_kernels(model) == 0
    assert all("forward" not in vars(m) for m in model.modules())


def test_the_policy_worker_trains_through_them(make_cfg):
    from trainers.policy import PolicyWorker

    worker = PolicyWorker(make_cfg(algo={"estimator": "gae", "kl_coef": 0.01}), with_engine=False)
    for model in (worker.model, worker.ref_model, worker.critic):
        assert "forward" in vars(model.get_decoder().norm)
