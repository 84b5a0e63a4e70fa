"""The README is the front door (#35): short, its set-up commands and headline numbers there,
each number beside its results file, what has never run on a GPU plainly stated, and every link
landing on a file. The reference material it held lives in docs/, whose code
tests/docs/ runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def test_readme_is_a_short_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for command in ("make setup", "make train", "make test", "make lint", "make docs",
                    "agentrl train --env math-tir"):
        assert command in text, command


def test_every_link_lands_on_a_file():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text)
    assert len(targets) > 20
    for target in targets:
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_each_headline_names_its_command_and_results_file():
    paragraphs = _section(README.read_text(), "Headline results").strip().split("\n\n")
    headlines = [p for p in paragraphs if p.startswith("**")]
    assert len(headlines) >= 5
    for paragraph in headlines:
        results = re.findall(r"\((benchmarks/results/[a-z_]+\.md)\)", paragraph)
        assert results, f"a headline without its results file: {paragraph[:80]!r}"
        assert "`" in paragraph, f"a headline without its command: {paragraph[:80]!r}"
    text = README.read_text()
    for number in ("0.000 -> 0.625", "0.156 -> 0.938", "0.104 -> 0.625", "0.219 -> 0.984", "1.73x"):
        assert number in text, number


def test_what_never_ran_on_a_gpu_is_plain():
    section = _section(README.read_text(), "Never run on a GPU yet")
    for thing in ("one GPU only, without Ray or vLLM", "vLLM", "QLoRA", "Ray actors on GPUs",
                  "FSDP2 and DeepSpeed over several GPUs"):
        assert thing in section, thing


def test_the_algorithm_table_names_real_estimators():
    from agentrl.algorithms import ADVANTAGE_ESTIMATORS

    table = _section(README.read_text(), "Algorithms")
    rows = re.findall(r"^\| `([a-z_]+)` \|", table, re.MULTILINE)
    assert len(rows) >= 6
    for name in rows:
        assert name in ADVANTAGE_ESTIMATORS, f"the README's table lists {name!r}, no estimator"
