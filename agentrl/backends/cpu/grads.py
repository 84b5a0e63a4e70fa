"""Gradient shortcuts for float32 training on a CPU: the tied embedding's rows added in place,
and the clipping norm from dot products. Both equal autograd's / torch's results up to float32
round-off (tests/backends/test_grads.py)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def tied_embedding_rows_in_place(model: nn.Module) -> bool:
    """Replace the model's input embedding by a `RowsInPlaceEmbedding` if its weight is shared
    with the lm_head, and say whether it is (now) one.

    Through autograd, both uses of a tied weight feed one gradient accumulation: the lm_head's
    dense [vocab, hidden] gradient and the embedding's (a zero-filled dense one, or a sparse one
    with `sparse=True`) are summed out of place, ~36 ms and a fresh 113 MB tensor a backward for
    SmolLM2-135M on CPU. A `RowsInPlaceEmbedding` looks up a detached weight and a hook on its
    output adds the few looked-up rows (`index_add_`) into `.grad`, which then holds the
    lm_head's gradient as autograd produced it. The sum is the same, up to float32 round-off in
    the order of the additions; the padding row gets no gradient, as with
    `nn.Embedding(padding_idx=...)`. The replacement holds the same weight Parameter under the
    same name: the state_dict and the tie are unchanged. For the local backend only, FSDP2 and
    DeepSpeed owning the gradients.
    """
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    if get_input is None or get_output is None:
        return False  # not a language model (the critic's backbone keeps autograd's gradient)
    embedding, head = get_input(), get_output()
    if isinstance(embedding, RowsInPlaceEmbedding):
        return True
    if type(embedding) is not nn.Embedding or head is None:
        return False
    if head.weight is not embedding.weight:
        return False
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return False
    path = next(name for name, m in model.named_modules() if m is embedding)
    model.set_submodule(path, RowsInPlaceEmbedding.from_module(embedding))
    return True


class RowsInPlaceEmbedding(nn.Embedding):
    """An `nn.Embedding` over a weight tied to the lm_head, whose gradient rows are added in
    place into `weight.grad` (see `tied_embedding_rows_in_place`)."""

    replaces: type[nn.Module]
    """The replaced module's class (the lean decode step reads the weight as its)."""

    @classmethod
    def from_module(cls, embedding: nn.Embedding) -> RowsInPlaceEmbedding:
        """A stand-in for `embedding` holding its very weight Parameter (no copy) and hooks."""
        new = cls(
            embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
            _weight=embedding.weight.detach(),  # no fresh initialisation; replaced just below
        )
        new.weight = embedding.weight
        new.replaces = type(embedding)
        take_over_hooks(new, embedding)
        return new

    def forward(self, input: Tensor) -> Tensor:
        weight = self.weight
        out = F.embedding(input, weight.detach(), self.padding_idx)
        if torch.is_grad_enabled() and weight.requires_grad:
            out.requires_grad_()
            out.register_hook(functools.partial(_add_embedding_rows, self, input))
        return out


def take_over_hooks(stand_in: nn.Module, module: nn.Module) -> None:
    """Give `stand_in` the module hooks registered on the `module` it replaces (transformers
    registers some, e.g. on the input embedding for gradient checkpointing): the very hook
    dicts, so the handles returned when they were registered still remove them."""
    for name in _HOOK_ATTRS:
        setattr(stand_in, name, getattr(module, name))


_HOOK_ATTRS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks", "_is_full_backward_hook", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def _add_embedding_rows(embedding: torch.nn.Embedding, ids: Tensor, grad: Tensor) -> None:
    weight = embedding.weight
    rows = grad.reshape(-1, grad.shape[-1])
    flat = ids.reshape(-1)
    if embedding.padding_idx is not None:
        keep = flat != embedding.padding_idx
        rows, flat = rows[keep], flat[keep]
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, flat, rows.to(weight.grad.dtype))


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` (same formula, NaN and inf handled alike) with two
    shortcuts for float32 CPU gradients (SmolLM2-135M's, cold caches: 60 -> 29 ms for the norm):

    - the norm comes from one dot product per tensor (a sum of squares: equal to torch's
      per-tensor `vector_norm`s up to float32 round-off), which reads the gradients ~2x
      faster than `vector_norm` on this CPU;
    - there is no scaling when it would scale by exactly 1.0, i.e. when `max_norm / (norm +
      1e-6) >= 1` (torch's formula): torch multiplies every gradient anyway to spare
      accelerators a host sync, which we pay for the logged norm regardless (~30 ms a step).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grads and all(g.dtype is torch.float32 and g.device.type == "cpu" for g in grads):
        squares = [torch.dot(g.reshape(-1), g.reshape(-1)) for g in grads]
        norm = torch.stack(squares).sum().sqrt()
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    if not bool(max_norm / (norm + 1e-6) >= 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
