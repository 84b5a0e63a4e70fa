"""`agentrl export RUN_DIR --merge`: a plain Hugging Face model directory from a LoRA run.

A run trained with `--actor.lora_rank` (train, sft, dpo, rm) saves its adapters as
RUN_DIR/adapter (peft's format) and the merged model as RUN_DIR/hf at the end
(`agentrl.models.lora.save_trained`, which every trainer ends with, on one rank or many). This
command merges the adapters of RUN_DIR/adapter, or of another adapter directory (`--adapter`),
into the base model the run's config.json names and writes a directory that loads without peft. A
QLoRA run's adapters merge into its base as the run held it, in 4 bits (dequantized): the
model it trained, as its own RUN_DIR/hf is.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

from agentrl.command_line import parse_flags


@dataclass(frozen=True, kw_only=True)
class ExportArgs:
    run_dir: tyro.conf.Positional[str]
    """The run directory (it holds config.json and adapter/)."""
    merge: bool = False
    """Merge the LoRA adapters into the base weights (the only export there is, for now)."""
    adapter: str | None = None
    """Adapter directory (default: RUN_DIR/adapter)."""
    out: str | None = None
    """Where to write the model (default: RUN_DIR/hf)."""


def export(args: ExportArgs) -> Path:
    from agentrl.models import load_model, load_tokenizer
    from agentrl.models.lora import save_merged

    if not args.merge:
        raise ValueError("say what to export: --merge (LoRA adapters merged into the base "
                         "model, as a plain Hugging Face directory)")
    run = Path(args.run_dir)
    config = run / "config.json"
    if not config.is_file():
        raise ValueError(f"{run} is not a run directory (no config.json)")
    actor = json.loads(config.read_text()).get("actor", {})
    base = actor.get("model")
    adapter = Path(args.adapter) if args.adapter else run / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise ValueError(f"{adapter} holds no LoRA adapter (adapter_config.json); was the run "
                         f"trained with --actor.lora_rank?")
    if not isinstance(base, str):
        raise ValueError(f"{config} names no base model (actor.model)")  # noqa: TRY004
    from peft import PeftModel

    if actor.get("load_in_4bit"):  # QLoRA: the adapters merge into the 4-bit base they trained on
        import torch

        from agentrl.models.lora import quantized_base

        frozen = quantized_base(base, actor.get("dtype", "float32"), torch.device("cpu"))
    else:
        frozen = load_model(base)
    model = PeftModel.from_pretrained(frozen, str(adapter))
    out = Path(args.out) if args.out else run / "hf"
    save_merged(model, load_tokenizer(base), out)
    return out


def main(argv: list[str]) -> int:
    args = parse_flags(ExportArgs, argv, prog="agentrl export", doc=__doc__)
    try:
        out = export(args)
    except ValueError as e:
        print(f"agentrl export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
