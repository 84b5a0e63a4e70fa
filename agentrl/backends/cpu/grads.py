"""Gradient shortcuts for float32 training on a CPU: the tied embedding's rows added in place,
and the clipping norm from dot products. Both equal autograd's / torch's results up to float32
round-off (tests/backends/test_grads.py)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def tied_embedding_rows_in_place(model: torch.nn.Module) -> bool:
    """Add the input embedding's gradient rows in place into the weight's `.grad` if the weight
    is shared with the lm_head, and say whether it is.

    Through autograd, both uses of a tied weight feed one gradient accumulation: the lm_head's
    dense [vocab, hidden] gradient and the embedding's (a zero-filled dense one, or a sparse one
    with `sparse=True`) are summed out of place, ~36 ms and a fresh 113 MB tensor a backward for
    SmolLM2-135M on CPU. Here the lookup reads a detached weight and a hook on its output adds
    the few looked-up rows (`index_add_`) into `.grad`, which then holds the lm_head's gradient
    as autograd produced it. The sum is the same, up to float32 round-off in the order of the
    additions; the padding row gets no gradient, as with `nn.Embedding(padding_idx=...)`. For the
    local backend only, FSDP2 and DeepSpeed owning the gradients.
    """
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    if get_input is None or get_output is None:
        return False  # not a language model (the critic's backbone keeps autograd's gradient)
    embedding, head = get_input(), get_output()
    if type(embedding) is not torch.nn.Embedding or head is None:
        return False
    if head.weight is not embedding.weight:
        return False
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return False
    # A partial of the module (not a closure over its weight): copies of the model get their own.
    embedding.forward = functools.partial(  # type: ignore[method-assign]
        _embedding_rows_in_place_forward, embedding
    )
    return True


def _embedding_rows_in_place_forward(embedding: torch.nn.Embedding, input_ids: Tensor) -> Tensor:
    weight = embedding.weight
    out = F.embedding(input_ids, weight.detach(), embedding.padding_idx)
    if torch.is_grad_enabled() and weight.requires_grad:
        out.requires_grad_()
        out.register_hook(functools.partial(_add_embedding_rows, embedding, input_ids))
    return out


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
