"""Sampling engines: the `Engine` protocol and its backends (transformers default, vLLM optional).

Backends import torch/transformers/vllm lazily; importing this package does not.
"""

from agentrl.engine.base import Engine, NamedTensors, PromptTooLongError

__all__ = ["Engine", "NamedTensors", "PromptTooLongError"]
