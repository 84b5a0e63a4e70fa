"""Test models for the engine tests."""

from __future__ import annotations


def sharp_tiny_model(tokenizer, seed: int = 1):
    """The tiny Llama with weights scaled up: random init is near-uniform, and larger weights
    give varied argmaxes, so greedy parity tests compare something."""
    import torch

    from agentrl.models.tiny import tiny_model

    model = tiny_model(tokenizer, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    return model
