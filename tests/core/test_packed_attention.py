"""Attention one packed sequence at a time (agentrl.models.packed_attention) against SDPA over
the row's whole [L, L] mask: the same outputs and gradients, and the mask path untouched for
every call that brings no layout (or one that does not fit)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

from agentrl.models import packed_attention
from agentrl.models.packed_attention import PackedLayout, segment_attention

# A shared prefix of 5 with rests of 3, 0 (a sequence that is all prefix), 1 and 4; a lone
# sequence of 6; a group that shares nothing (2 and 3).
GROUPS = ((5, (3, 0, 1, 4)), (0, (6,)), (0, (2, 3)))


class Heads(nn.Module):
    """What transformers' SDPA function reads off an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


def dense_mask(groups: tuple) -> torch.Tensor:
    """[1, 1, L, L] bool: what `trainers.batch.pack` builds for the same row."""
    seg, owner, pos = [], [], []
    u = 0
    for g, (prefix, rests) in enumerate(groups):
        seg += [g] * prefix
        owner += [-1] * prefix
        pos += list(range(prefix))
        for r in rests:
            seg += [g] * r
            owner += [u] * r
            pos += list(range(prefix, prefix + r))
            u += 1
    s, o, p = torch.tensor(seg), torch.tensor(owner), torch.tensor(pos)
    # Causal by position within a sequence; whole groups without a prefix: one owner each.
    return ((s[:, None] == s[None, :]) & (p[None, :] <= p[:, None])
            & ((o[None, :] == -1) | (o[None, :] == o[:, None])))[None, None]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_each_piece_attends_to_what_the_mask_allows(kv_heads):
    layout = PackedLayout(GROUPS)
    L, H, D = layout.length, 4, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, D, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, L, D, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, L, D, generator=g, requires_grad=True)
    module = Heads(H // kv_heads)
    mask = dense_mask(GROUPS)
    w = torch.randn(1, L, H, D, generator=g)

    got, _ = segment_attention(module, q, k, v, mask, scaling=D**-0.5, packed_layout=layout)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    ref, _ = sdpa(module, q, k, v, mask, scaling=D**-0.5)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert got.shape == ref.shape == (1, L, H, D)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_calls_without_a_fitting_layout_take_sdpa_with_their_mask(monkeypatch):
    """No layout, another length, a sliding window, attention that is not causal (a vision
    tower's): transformers' SDPA function with the mask given, whatever the layout says."""
    layout = PackedLayout(GROUPS)
    L = layout.length
    q, k, v = (torch.randn(1, 2, L, 4) for _ in range(3))
    mask = torch.ones(1, 1, L, L, dtype=torch.bool).tril()  # plain causal: not the layout's
    ref, _ = sdpa(Heads(1), q, k, v, mask)
    for kw in ({}, {"packed_layout": PackedLayout(((0, (L - 1,)),))},
               {"packed_layout": layout, "sliding_window": 4}):
        got, _ = segment_attention(Heads(1), q, k, v, mask, **kw)
        torch.testing.assert_close(got, ref)
    # A vision tower's attention (not causal), whatever its length.
    tower = Heads(1)
    tower.is_causal = False
    got, _ = segment_attention(tower, q, k, v, mask, packed_layout=layout)
    torch.testing.assert_close(got, sdpa(tower, q, k, v, mask)[0])
    got, _ = segment_attention(Heads(1), q, k, v, mask, packed_layout=layout)
    assert not torch.allclose(got, ref)  # the layout's pieces do differ from a causal row


def test_a_model_forward_hands_the_layout_to_every_layer(monkeypatch):
    """Registered as "sdpa", the function gets `packed_layout` from the model's forward: the
    tiny Llama's logits with the layout equal those with the dense mask, and every layer
    attended piece by piece."""
    from agentrl.models.tiny import tiny_model, tiny_tokenizer

    model = tiny_model(tiny_tokenizer(), seed=0).eval()
    assert model.config._attn_implementation == packed_attention.NAME
    packed_attention.register()
    layout = PackedLayout(GROUPS)
    L = layout.length
    ids = torch.randint(3, 100, (1, L), generator=torch.Generator().manual_seed(1))
    pos = [x for p, rests in GROUPS for x in [*range(p), *(y for r in rests
                                                         for y in range(p, p + r))]]
    position_ids = torch.tensor([pos])
    pieces = []
    spy = packed_attention.PackedLayout.mask

    def counted(self, prefix, rest):
        pieces.append((prefix, rest))
        return spy(self, prefix, rest)

    monkeypatch.setattr(packed_attention.PackedLayout, "mask", counted)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=position_ids,
                    attention_mask=dense_mask(GROUPS)).logits
        got = model(input_ids=ids, position_ids=position_ids, attention_mask=dense_mask(GROUPS),
                    packed_layout=layout).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert len(pieces) == model.config.num_hidden_layers * 3  # rests 3, 1, 4 after the prefix
