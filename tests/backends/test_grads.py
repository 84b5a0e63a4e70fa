"""agentrl.backends.cpu.grads against what they replace: the tied embedding's gradient rows added
in place against autograd, the clipping norm from dot products against torch's."""

from __future__ import annotations

import copy

import pytest
import torch

from agentrl.backends.cpu.grads import RowsInPlaceEmbedding
from agentrl.backends.cpu.grads import clip_grad_norm as _clip_grad_norm
from agentrl.backends.cpu.grads import tied_embedding_rows_in_place as _tied_embedding_rows_in_place


def test_embedding_rows_in_place_only_for_tied_weights(make_cfg):
    from agentrl.models import load_model
    from trainers.policy import PolicyWorker

    untied = load_model("tiny")
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert not _tied_embedding_rows_in_place(untied)
    assert type(untied.get_input_embeddings()) is torch.nn.Embedding
    worker = PolicyWorker(make_cfg(algo={"estimator": "gae"}), with_engine=False)
    assert worker.policy.embedding_rows_in_place
    # The critic is a copy of the backbone taken before: its embedding is left alone.
    assert worker.critic is not None
    assert type(worker.critic.module.backbone.embed_tokens) is torch.nn.Embedding
    assert isinstance(worker.model.get_input_embeddings(), RowsInPlaceEmbedding)


class _Tied(torch.nn.Module):
    def __init__(self, padding_idx):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4, padding_idx=padding_idx)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_rows_in_place_equal_autograd(padding_idx):
    """A tied embedding + head: the rows added in place give autograd's gradient (padding row
    excluded), accumulate over backwards, and a no-grad lookup adds nothing."""
    torch.manual_seed(0)
    ref = _Tied(padding_idx)
    fast = copy.deepcopy(ref)
    assert _tied_embedding_rows_in_place(fast)
    head_only = copy.deepcopy(ref)
    ids = [torch.tensor([[1, 3, 3, 7, 1, 10]]), torch.tensor([[3, 0, 2, 2]])]
    for x in ids:  # two backwards: the second accumulates into the existing .grad
        w = torch.randn(x.shape[1], 11)
        (ref(x) * w).sum().backward()
        (fast(x) * w).sum().backward()
        (head_only.head(torch.tanh(head_only.emb(x).detach())) * w).sum().backward()
    torch.testing.assert_close(fast.emb.weight.grad, ref.emb.weight.grad, rtol=1e-6, atol=1e-6)
    # Against the head's gradient alone, exactly the looked-up rows (but padding) differ.
    looked_up = {int(i) for x in ids for i in x.flatten()} - {padding_idx}
    for row in range(11):
        same = torch.allclose(fast.emb.weight.grad[row], head_only.emb.weight.grad[row])
        assert same == (row not in looked_up), row
    with torch.no_grad():
        before = fast.emb.weight.grad.clone()
        fast(ids[0])
    assert torch.equal(fast.emb.weight.grad, before)
    # A copy adds its rows into its own weight's gradient, not the original's.
    twin = copy.deepcopy(fast)
    twin.zero_grad(set_to_none=True)
    twin(ids[0]).sum().backward()
    assert torch.equal(fast.emb.weight.grad, before) and twin.emb.weight.grad is not None


def test_embedding_rows_in_place_keep_the_module_its_name_and_hooks():
    """The stand-in holds the very weight under the same key (state_dict unchanged, tie kept)
    and runs the hooks registered on the embedding it replaced (transformers registers one for
    gradient checkpointing), whose handles still remove them."""
    model = _Tied(None)
    want = model.state_dict(keep_vars=True)
    calls = []
    handle = model.emb.register_forward_hook(lambda m, i, o: calls.append(o.requires_grad))
    assert _tied_embedding_rows_in_place(model)
    assert isinstance(model.emb, RowsInPlaceEmbedding) and model.head.weight is model.emb.weight
    got = model.state_dict(keep_vars=True)
    assert list(got) == list(want) and all(got[k] is want[k] for k in want)
    model(torch.tensor([[1, 2]])).sum().backward()
    assert calls == [True]
    handle.remove()
    model(torch.tensor([[1, 2]]))
    assert calls == [True]
    assert _tied_embedding_rows_in_place(model)  # idempotent


@pytest.mark.parametrize(
    ("ratio", "poison", "scales"),
    [
        (2.0, None, False),  # max_norm = 2 norm: torch would multiply by exactly 1.0
        (1.0 + 1e-7, None, True),  # above the norm, below norm + 1e-6: torch scales by < 1
        (1.0, None, True),  # at the norm
        (0.3, None, True),  # below the norm
        (2.0, float("nan"), True),  # NaN norm: grads become NaN, as with torch
        (2.0, float("inf"), True),  # inf norm: scaled by 0 (inf * 0 = NaN), as with torch
    ],
)
def test_clip_grad_norm_matches_torch(monkeypatch, ratio, poison, scales):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((40, 30), (7,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 0.1  # norm ~3.5: float32 resolves 1e-6
    # Relative to our own norm (torch's may differ in the last bit, which matters at 1 + 1e-7).
    max_norm = float(_clip_grad_norm(params, float("inf"))) * ratio
    if poison is not None:
        params[1].grad[3] = poison
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params, strict=True):
        r.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    calls = []
    clip = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(
        torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: calls.append(1) or clip(*a, **k)
    )
    got = _clip_grad_norm(params, max_norm)
    assert bool(calls) == scales
    # Sums of squares in another order than torch's per-tensor norms: equal up to round-off.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0, equal_nan=True)


def test_clip_grad_norm_of_other_dtypes_is_torch_s():
    params = [torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16)) for _ in range(2)]
    for k, p in enumerate(params):
        p.grad = torch.linspace(-1, 1 + k, 5, dtype=torch.bfloat16)
    want = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert torch.equal(_clip_grad_norm(params, 1e9), want)
