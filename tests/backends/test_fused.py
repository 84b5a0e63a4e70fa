"""The fused training kernels (agentrl/backends/cpu/fused.py, csrc/cpu_train.cpp) against
autograd on the modules they replace: values and gradients equal up to float32 round-off, the
stand-in modules swapped in only where the arithmetic is the Llama one (the stock modules
elsewhere), with the model's state_dict unchanged and the lean decode step still applying."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from agentrl.backends.cpu import calibrate, fused, kernels

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("ninja") is None,
    reason="the kernels are compiled with g++ and ninja",
)


@pytest.fixture(scope="module", autouse=True)
def module():
    mod = kernels.module()
    assert mod is not None, "the CPU kernels did not build (see the warning logged above)"
    return mod


def _fused_modules(model):
    return [m for m in model.modules() if isinstance(m, (fused.FusedRMSNorm, fused.FusedSwiGLUMLP))]


@pytest.mark.parametrize(("rows", "width"), [(1, 16), (7, 100), (333, 64), (1000, 48)])
def test_rms_norm_matches_autograd(rows, width):
    # Widths off the vector width (4, 8 or 16 lanes) reach the scalar tails; 1000 rows span
    # several chunks of the per-thread weight gradient.
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
    got = fused.rms_norm(x, norm.weight, 1e-6)
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
    got = fused.swiglu(gate, up)
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
    # The kernels ran: the stock modules' forward is not bit-identical.
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)


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
    assert type(gelu.model.norm) is OnePlusRMSNorm
    assert all(type(layer.mlp) is LlamaMLP for layer in gelu.model.layers)
    assert all(type(layer.input_layernorm) is fused.FusedRMSNorm for layer in gelu.model.layers)


def test_nothing_is_routed_without_the_kernels(monkeypatch):
    from agentrl.models import load_model

    monkeypatch.setattr(kernels, "module", lambda: None)
    model = load_model("tiny")
    assert fused.use_fused_kernels(model) == 0
    assert not _fused_modules(model)


@pytest.mark.parametrize("measured_faster", [True, False])
def test_the_cpu_backend_routes_them_only_where_measured_faster(
    make_cfg, monkeypatch, measured_faster
):
    from trainers.policy import PolicyWorker

    on = calibrate.Choice(decode=False, decode_wide=False, train=measured_faster, logprobs=False,
                          speedups={})
    monkeypatch.setattr(calibrate, "choice", lambda: on)
    worker = PolicyWorker(make_cfg(algo={"estimator": "gae", "kl_coef": 0.01}), with_engine=False)
    assert worker.ref is not None and worker.critic is not None
    for backend in (worker.policy, worker.ref, worker.critic):
        norm = backend.module.get_decoder().norm
        assert isinstance(norm, fused.FusedRMSNorm) == measured_faster


def test_the_swaps_leave_the_state_dict_and_weights_as_they_were(monkeypatch):
    """The cpu backend's stand-ins (fused norms and MLPs, the tied embedding) hold the model's
    own tensors under the same names: state_dict keys, order, values and storage, parameter
    (and so optimizer-state) order, full_weights (engine sync, export) and the tie unchanged."""
    from agentrl.backends import OptimizerSpec, create_backend
    from agentrl.backends.cpu.grads import RowsInPlaceEmbedding
    from agentrl.models import load_model

    monkeypatch.setenv(kernels.ENV, "1")
    model = load_model("tiny").train()
    stock = copy.deepcopy(model)
    want = model.state_dict()
    storage = {k: v.data_ptr() for k, v in want.items()}
    names = [n for n, _ in model.named_parameters()]
    cpu, local = create_backend("cpu"), create_backend("local")
    cpu.setup(model, OptimizerSpec(lr=1e-3), torch.device("cpu"))
    local.setup(stock, OptimizerSpec(lr=1e-3), torch.device("cpu"))
    layers = model.config.num_hidden_layers
    assert len(_fused_modules(model)) == 3 * layers + 1
    assert isinstance(model.get_input_embeddings(), RowsInPlaceEmbedding)
    assert model.lm_head.weight is model.get_input_embeddings().weight

    got = model.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].data_ptr() == storage[k] for k in want)
    assert [n for n, _ in model.named_parameters()] == names
    params = cpu.optimizer.param_groups[0]["params"]
    assert [p.shape for p in params] == [p.shape for p in local.optimizer.param_groups[0]["params"]]
    full, ref = list(cpu.full_weights()), list(local.full_weights())
    assert [n for n, _ in full] == [n for n, _ in ref]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(full, ref, strict=True))
    # A checkpoint of either loads strictly into the other.
    fresh = load_model("tiny")
    fresh.load_state_dict(cpu.state_dict()["model"])
    cpu.load_state_dict(local.state_dict())
    assert model.lm_head.weight is model.get_input_embeddings().weight


async def test_the_lean_decode_step_reads_the_stand_ins(tiny_tokenizer, prompts, monkeypatch):
    """After the cpu backend's swaps the engine still runs the lean decode step, and with the
    kernels turned off afterwards the stand-ins compute exactly as the stock modules: the same
    tokens and logprobs, bit for bit."""
    from agentrl.backends import OptimizerSpec, create_backend
    from agentrl.backends.cpu.decode import decode_logits
    from agentrl.completion import SamplingParams
    from tests.engine._models import generate_with_decode_step, sharp_tiny_model

    monkeypatch.setenv(kernels.ENV, "1")
    stock = sharp_tiny_model(tiny_tokenizer)
    swapped = copy.deepcopy(stock)
    create_backend("cpu").setup(swapped, OptimizerSpec(lr=1e-3), torch.device("cpu"))
    assert _fused_modules(swapped)
    monkeypatch.setenv(kernels.ENV, "0")
    requests = [(p, SamplingParams(temperature=1.0, max_tokens=8, seed=3)) for p in prompts[:3]]
    results = []
    for model in (stock, swapped):
        model.eval()
        completions, counters = await generate_with_decode_step(
            model, tiny_tokenizer, requests, decode_logits
        )
        results.append(completions)
        assert counters["lean_decode_steps"] == counters["decode_steps"] > 0
    assert results[0] == results[1]


def test_stand_ins_refuse_other_modules_and_take_over_hooks():
    from agentrl.models import load_model

    model = load_model("tiny")
    with pytest.raises(TypeError, match="FusedSwiGLUMLP replaces a SiLU-gated"):
        fused.FusedSwiGLUMLP.from_module(model.model.norm)
    with pytest.raises(TypeError, match="FusedRMSNorm replaces a Llama-style RMSNorm"):
        fused.FusedRMSNorm.from_module(model.model.layers[0].mlp)
    # Hooks registered before the swap run on the stand-in, and their handles still remove them.
    calls = []
    handles = [
        model.model.norm.register_forward_hook(lambda m, i, o: calls.append(type(m))),
        model.model.layers[0].mlp.register_forward_pre_hook(lambda m, i: calls.append(type(m))),
    ]
    assert fused.use_fused_kernels(model) == 3 * model.config.num_hidden_layers + 1
    model(input_ids=torch.arange(5)[None])
    assert calls == [fused.FusedSwiGLUMLP, fused.FusedRMSNorm]
    for handle in handles:
        handle.remove()
    model(input_ids=torch.arange(5)[None])
    assert len(calls) == 2


def _logits(rows, vocab, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * scale
    labels = torch.randint(0, vocab, (rows,), generator=g)
    return z, labels, torch.randn(rows, generator=g), torch.randn(rows, generator=g)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 5), (37, 1003), (64, 4096)])
@pytest.mark.parametrize("grads", ["both", "logp", "entropy"])
def test_logprobs_and_entropy_match_the_algorithms_function(temperature, rows, vocab, grads):
    # Vocabularies off the vector width (4, 8 or 16 lanes) reach the scalar tails of each row.
    from agentrl.algorithms import logprobs_and_entropy_from_logits

    z, labels, g, h = _logits(rows, vocab, rows + vocab)
    for into in (False, True):
        ref = z.clone().requires_grad_()
        want_lp, want_ent = logprobs_and_entropy_from_logits(ref[None], labels[None], temperature)
        mine = z.clone().requires_grad_()
        logits = mine * 1  # the kernel may take this tensor's memory, not the leaf's
        lp, ent = fused.logprobs_and_entropy(logits, labels, temperature, into_logits=into)
        torch.testing.assert_close(lp, want_lp[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, want_ent[0], rtol=1e-5, atol=1e-5)
        wg, wh = {"both": (g, h), "logp": (g, 0 * h), "entropy": (0 * g, h)}[grads]
        if grads == "logp":  # the entropy a logged metric only: no gradient reaches it
            ent, want_ent = ent.detach(), want_ent.detach()
        if grads == "entropy":
            lp, want_lp = lp.detach(), want_lp.detach()
        ((lp * wg).sum() + (ent * wh).sum()).backward()
        ((want_lp[0] * wg).sum() + (want_ent[0] * wh).sum()).backward()
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-4, atol=1e-6)
        assert into == (logits._version > 0)  # the gradient went over the logits


def test_logprobs_and_entropy_at_extreme_and_nan_logits():
    # A spread of 2000 underflows most of p (0 there, as xlogy), a -inf logit (a masked token)
    # has p = 0 and no gradient, and a NaN logit poisons its own row only: the NaN-loss guard
    # downstream needs to see it.
    from agentrl.algorithms import logprobs_and_entropy_from_logits

    z = torch.linspace(-1000, 1000, 3 * 50).reshape(3, 50)
    z[2, 7] = float("nan")
    z[1, 20:40] = float("-inf")  # 20 columns: whole vectors of 4, 8 or 16 lanes, and tails
    # torch's forward gives the entropy -(logp * p).sum() = NaN there (-inf * 0); the entropy
    # without those columns is what it means.
    finite = torch.cat([z[1, :20], z[1, 40:]])
    want_ent_1 = -(torch.log_softmax(finite, -1) * torch.softmax(finite, -1)).sum()
    labels = torch.tensor([49, 0, 3])
    ref, mine = z.clone().requires_grad_(), z.clone().requires_grad_()
    want_lp, want_ent = logprobs_and_entropy_from_logits(ref[None], labels[None])
    lp, ent = fused.logprobs_and_entropy(mine, labels, 1.0)
    torch.testing.assert_close(lp, want_lp[0], equal_nan=True)
    torch.testing.assert_close(ent[0], want_ent[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[1], want_ent_1, atol=1e-5, rtol=0)
    assert torch.isnan(lp[2]) and torch.isnan(ent[2]) and not torch.isnan(lp[:2]).any()
    (lp[:2].sum() + ent[:2].sum()).backward()
    (want_lp[0][:2].sum() + want_ent[0][:1].sum()).backward()  # row 1's entropy: NaN in torch
    assert torch.equal(mine.grad[1, 20:40], torch.zeros(20))
    torch.testing.assert_close(mine.grad[0], ref.grad[0])
    torch.testing.assert_close(mine.grad[2], ref.grad[2], equal_nan=True)  # NaN stays NaN


def test_logprobs_and_entropy_bad_input_and_fallback():
    z, labels, _, _ = _logits(4, 100, 0)
    with pytest.raises(RuntimeError, match=r"labels must be in \[0, 100\)"):
        fused.logprobs_and_entropy(z, labels + 100, 1.0)
    assert fused.logprobs_and_entropy(z.bfloat16(), labels, 1.0) is None  # torch's function then
    assert fused.logprobs_and_entropy(z, labels, 0.0) is None  # which raises its own error
    # A logits tensor that autograd saved elsewhere: writing its gradient over it fails loudly.
    x = z.clone().requires_grad_()
    logits = x.exp()  # exp's backward reads its output
    lp, _ = fused.logprobs_and_entropy(logits, labels, 1.0, into_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()
