"""What `embedded-vlm`'s vision tower sees on MiniWoB++ click-color screenshots (#33 item 4).

click-color shows four 52 x 52 boxes of different CSS colours (13 colours, shuffled) at four
fixed places and names one ("Click on the olive colored box."); clicking a box ends the episode
(+ for the named one, -1 for another). This script measures, on held-out (`eval`) pages:

1. the image-blind ceiling: a policy that never looks at the image clicks one fixed place; each
   of the four box centres is run through the env on `--episodes` seeds (the boxes' colours
   are shuffled independently of the goal, so the exact ceiling is 1/4);
2. the tower: the hand-set tower writes the position of its reddest patch (largest R - G) into
   every patch (`embedded_vlm._RED`); the caption the projector was aligned to say is
   "red square at (x, y)" in the 112 x 112 frame the image processor makes (the 160 x 210
   screenshot resized to 112 x 147 and centre-cropped). For each page: the reported patch, its
   point as the caption says it (what the warm-up taught the model to copy into click(x, y)),
   that point mapped back into screenshot pixels, and which box (if any) each falls in;
3. the best success any policy can reach that sees the goal text and the tower's reported
   patch (and nothing else of the image): per (goal colour, reported patch), the box most often
   the target, scored on a second half of the pages (fitted on the first).

    python benchmarks/miniwob_vision_probe.py --episodes 100 --pages 400 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter, defaultdict
from typing import Any

import numpy as np
from machine import cpu_description  # benchmarks/machine.py

BOXES = ((49, 103), (111, 103), (49, 167), (111, 167))
"""click-color's four box centres in screenshot pixels (its layout; boxes 52 x 52)."""
HALF = 26
CSS = {"red": (255, 0, 0), "blue": (0, 0, 255), "olive": (128, 128, 0), "lime": (0, 255, 0),
       "black": (0, 0, 0), "white": (255, 255, 255), "grey": (128, 128, 128),
       "purple": (128, 0, 128), "orange": (255, 165, 0), "yellow": (255, 255, 0),
       "cyan": (0, 255, 255), "pink": (255, 192, 203), "magenta": (255, 0, 255)}
"""click-color's colours (its COLORS list) as CSS names them."""


def box_at(x: float, y: float) -> int | None:
    """The box (0-3) a point falls in, or None."""
    for i, (cx, cy) in enumerate(BOXES):
        if abs(x - cx) <= HALF and abs(y - cy) <= HALF:
            return i
    return None


def page_colours(image: np.ndarray) -> list[str]:
    """The colour of each box, read from its centre pixel."""
    names = list(CSS)
    return [names[int(np.argmin([np.abs(np.int32(image[cy, cx]) - np.int32(c)).sum()
                                 for c in CSS.values()]))] for cx, cy in BOXES]


def blind_ceiling(episodes: int) -> dict[str, float]:
    """Success of clicking each box centre on every page, whatever the screen shows."""
    from environments.miniwob.env import MiniWoBEnv

    env = MiniWoBEnv(task="click-color", observation="screenshot", split="eval", max_turns=1)
    out = {}
    try:
        for x, y in BOXES:
            wins = 0
            for seed in range(episodes):
                env.reset(seed=seed)
                *_, info = env.step(f"click({x}, {y})")
                wins += bool(info["correct"])
            out[f"click({x}, {y})"] = wins / episodes
    finally:
        env.close()
    return out


def pages(episodes: int, seed0: int) -> list[tuple[str, np.ndarray]]:
    """(goal colour, screenshot) of `episodes` held-out pages."""
    from environments.miniwob.env import MiniWoBEnv

    env = MiniWoBEnv(task="click-color", observation="screenshot", split="eval")
    out = []
    try:
        for seed in range(seed0, seed0 + episodes):
            msgs, _ = env.reset(seed=seed)
            text, image = msgs[-1]["content"][0]["text"], msgs[-1]["content"][1]["image"]
            goal = re.search(r"Click on the (\w+) colored box", text)
            assert goal is not None, text
            out.append((goal.group(1), image))
    finally:
        env.close()
    return out


def tower_reports(images: list[np.ndarray]) -> tuple[list[int], list[str]]:
    """For each screenshot: the patch (0-15) the built tower reports as the reddest, and the
    nearest vocabulary tokens to its image tokens' embeddings (what the language model reads)."""
    import torch

    from agentrl.models import load_model, load_tokenizer
    from agentrl.models.vision import vision_processor
    from environments.screenshot import embedded_vlm as ev

    model: Any = load_model(ev.EMBEDDED_VLM_NAME)
    tok = load_tokenizer(ev.EMBEDDED_VLM_NAME)
    vision = vision_processor(tok)
    assert vision is not None
    px = vision.model_inputs(images)["pixel_values"]
    table = model.get_input_embeddings().weight
    with torch.no_grad():
        hidden = model.model.vision_tower(px, output_hidden_states=True).hidden_states[-1]
        red = hidden[:, 0, ev._RED + 1 : ev._RED + 17].argmax(-1).tolist()
        feats = model.model.get_image_features(
            pixel_values=px, vision_feature_layer=-1,
            vision_feature_select_strategy="default").pooler_output
        words = [tok.decode(torch.cdist(f, table).argmin(-1)) for f in feats]
    return red, words


def caption_point(patch: int) -> tuple[int, int]:
    """The point the caption names for a patch: (x, y) in the 112 x 112 frame."""
    from environments.screenshot.embedded_vlm import PATCH

    r, q = divmod(patch, 4)
    return q * PATCH + PATCH // 2, r * PATCH + PATCH // 2


def to_screen(x: int, y: int) -> tuple[float, float]:
    """A point of the 112 x 112 frame in screenshot pixels: the processor scales the 160-pixel
    width to 112 and crops (147 - 112) / 2 rows off the top of the scaled image."""
    scale = 160 / 112
    return x * scale, y * scale + (210 - 112 * scale) / 2


def tower_ceiling(fit: list[dict[str, Any]], test: list[dict[str, Any]]) -> float:
    """Success on `test` of the policy fitted on `fit` that sees only the goal colour and the
    box the tower's reported patch maps to: the box most often the target for that pair
    (unseen pairs: the first box, the blind choice)."""
    counts: dict[tuple[str, int | None], Counter[int]] = defaultdict(Counter)
    for r in fit:
        counts[(r["goal"], r["mapped_box"])][r["target"]] += 1
    best = {k: c.most_common(1)[0][0] for k, c in counts.items()}
    return sum(r["target"] == best.get((r["goal"], r["mapped_box"]), 0) for r in test) / len(test)


def probe(episodes: int) -> dict[str, Any]:
    """The tower's reports on `episodes` held-out pages against where the target is."""
    shots = pages(episodes, seed0=10_000)
    patches, words = tower_reports([im for _, im in shots])
    rows = []
    for (goal, image), patch, said in zip(shots, patches, words, strict=True):
        colours = page_colours(image)
        caption = caption_point(patch)
        rows.append({"goal": goal, "colours": colours, "target": colours.index(goal),
                     "red": colours.index("red") if "red" in colours else None,
                     "patch": patch, "caption": caption, "caption_box": box_at(*caption),
                     "mapped_box": box_at(*to_screen(*caption)), "said": said})
    n = len(rows)
    red_goal = [r for r in rows if r["goal"] == "red"]
    red_shown = [r for r in rows if r["red"] is not None]
    return {
        "pages": n,
        "caption_point_in_target": sum(r["caption_box"] == r["target"] for r in rows) / n,
        "caption_point_in_any_box": sum(r["caption_box"] is not None for r in rows) / n,
        "mapped_point_in_target": sum(r["mapped_box"] == r["target"] for r in rows) / n,
        "goal_is_red": len(red_goal),
        "red_goal_mapped_point_in_target": (
            sum(r["mapped_box"] == r["target"] for r in red_goal) / max(1, len(red_goal))),
        "red_shown": len(red_shown),
        "red_shown_mapped_point_in_red_box": (
            sum(r["mapped_box"] == r["red"] for r in red_shown) / max(1, len(red_shown))),
        "reported_patches": dict(Counter(r["patch"] for r in rows).most_common()),
        # Fitted on one half, scored on the other (and in-sample: an optimistic bound).
        "tower_informed_ceiling_held_out": tower_ceiling(rows[: n // 2], rows[n // 2 :]),
        "tower_informed_ceiling_in_sample": tower_ceiling(rows, rows),
        "examples": rows[:6],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=100,
                    help="held-out episodes per fixed click of the blind ceiling")
    ap.add_argument("--pages", type=int, default=400, help="held-out pages the tower reads")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    result: dict[str, Any] = {"cpu": cpu_description(), "load_before": os.getloadavg()[0],
                              "blind": blind_ceiling(args.episodes),
                              "tower": probe(args.pages)}
    result["load_after"] = os.getloadavg()[0]
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
