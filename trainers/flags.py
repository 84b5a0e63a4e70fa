"""What every trainers command does to its flags before and after tyro parses them."""

from __future__ import annotations


def bool_values(argv: list[str], config_cls: type) -> list[str]:
    """Accept any case for the values of `config_cls`'s boolean flags (`--use_ray false`), as
    tyro takes only True/False."""
    flags, out = _bool_flags(config_cls), []
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if eq and flag in flags and value.lower() in ("true", "false"):
            a = f"{flag}={value.capitalize()}"
        elif i and argv[i - 1] in flags and a.lower() in ("true", "false"):
            a = a.capitalize()
        out.append(a)
    return out


def _bool_flags(cls: type, prefix: str = "--") -> set[str]:
    """The flags of boolean fields of a config dataclass, nested sections included."""
    import dataclasses
    import typing

    flags = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if kind is bool:
            flags.add(prefix + f.name)
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            flags |= _bool_flags(kind, f"{prefix}{f.name}.")
    return flags


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
