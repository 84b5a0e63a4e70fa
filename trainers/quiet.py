"""Keeping a run's console to agentrl's own output."""

from __future__ import annotations


def quiet_third_party() -> None:
    """Silence what other libraries print unasked during a run: Hugging Face's progress bars
    (a "Writing model shards" bar per checkpoint, the GGUF conversion's), and DeepSpeed's
    "Setting accelerator to CPU" warning (transformers imports DeepSpeed to save a model).
    As environment variables, so Ray workers started after this inherit them; a value the user
    set is kept."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
