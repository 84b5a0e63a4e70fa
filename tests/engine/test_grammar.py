"""What a grammar may cost (#34 item 4): schemas past the limits are refused before any work,
a compile past its timeout or with nobody waiting is stopped (its worker process killed), and
what was built is cached by a hash of what it was built from, within a memory bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentrl.engine import grammar
from agentrl.engine.grammar import (
    GrammarError,
    GrammarMasks,
    GrammarTooComplexError,
    json_schema_grammar,
    structural_tag_grammar,
)


def optional_properties(n: int, prefix: str = "p") -> dict:
    """A schema whose compile time no limit predicts: 2000 optional properties took 2-12 s to
    compile for the tiny 384-token vocabulary (1000, 1-2 s), in a 57 KB schema."""
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "string"}
                                             for i in range(n)},
            "additionalProperties": False}


@pytest.fixture
def masks(tiny_tokenizer):
    return GrammarMasks(tiny_tokenizer, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id])


LIMITS = [
    ("10^5 enum values", {"enum": [f"value{i:06d}" for i in range(100_000)]},
     "1500010 bytes of JSON, over the limit of 262144"),
    ("3000 enum values", {"type": "object", "properties": {
        "a": {"enum": list(range(2000))}, "b": {"enum": list(range(999)), "const": 1}}},
     "3000 enum and const values, over the limit of 1000"),
    ("1000 nested arrays", None, "nested deeper than 64 levels"),
]


@pytest.mark.parametrize(("name", "schema", "says"), LIMITS, ids=[c[0] for c in LIMITS])
def test_a_schema_past_a_limit_is_refused_before_any_work(name, schema, says):
    """The enum of 10^5 strings took ~42 s to compile and 1000 nested arrays (25 KB) 150 s to
    become a 27 MB grammar; now each is refused in well under a second, saying what to do."""
    if schema is None:
        schema = {"type": "string"}
        for _ in range(1000):
            schema = {"type": "array", "items": schema}
    start = time.monotonic()
    with pytest.raises(GrammarTooComplexError, match=says) as e:
        json_schema_grammar(schema, what="the schema 'x'")
    assert time.monotonic() - start < 1.0
    assert str(e.value).startswith("the schema 'x': ")
    assert isinstance(e.value, GrammarError)  # a GrammarError, as every refusal of a schema


def test_tool_schemas_count_against_the_limits_together():
    tags = [{"type": "tag", "begin": f"<{i}>", "end": "</>",
             "content": {"type": "json_schema", "json_schema": {"enum": list(range(600))}}}
            for i in range(2)]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
           "at_least_one": True, "stop_after_first": False}
    with pytest.raises(GrammarTooComplexError, match="the tools' .* 1200 enum"):
        structural_tag_grammar(fmt, what="the tools' parameters")
    tags[1]["content"]["json_schema"] = {"enum": list(range(300))}
    assert structural_tag_grammar(fmt, what="the tools' parameters")


def test_a_schema_is_turned_into_a_grammar_once(monkeypatch):
    import xgrammar as xgr

    calls = []
    real = xgr.Grammar.from_json_schema
    monkeypatch.setattr(xgr.Grammar, "from_json_schema",
                        staticmethod(lambda *a, **k: calls.append(1) or real(*a, **k)))
    schema = {"type": "object", "properties": {"once": {"type": "integer"}}}
    assert json_schema_grammar(schema) == json_schema_grammar(dict(schema))
    assert calls == [1]
    json_schema_grammar({**schema, "required": ["once"]})
    assert calls == [1, 1]


def test_the_cache_keeps_the_most_recently_used_within_its_bytes():
    cache = grammar._BoundedCache(100)
    for key, size in ((b"a", 40), (b"b", 40)):
        cache.put(key, key.decode(), size)
    assert cache.get(b"a") == "a"  # now b is the least recently used
    cache.put(b"c", "c", 40)
    assert (cache.get(b"a"), cache.get(b"b"), cache.get(b"c")) == ("a", None, "c")
    assert cache.bytes == 80
    cache.put(b"huge", "huge", 101)  # bigger than the whole cache: not kept
    assert cache.get(b"huge") is None and len(cache) == 2


async def test_a_compile_past_its_timeout_is_stopped_and_refused(tiny_tokenizer):
    masks = GrammarMasks(tiny_tokenizer, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id],
                         compile_timeout_s=0.5)
    await masks.compile('root ::= "warm"')  # the worker has started
    killed = masks.killed
    slow = json_schema_grammar(optional_properties(2000, "timeout"))
    start = time.monotonic()
    with pytest.raises(GrammarTooComplexError, match=r"did not compile within 0\.5 s"):
        await masks.compile(slow)
    assert time.monotonic() - start < 3
    assert masks.killed == killed + 1
    assert await masks.compile('root ::= "after"')  # another worker takes over


async def test_a_compile_nobody_waits_for_is_stopped(masks):
    """#34 item 4: a compile went on after its client had gone. Requests for one grammar
    share its compile; it stops when the last of them is cancelled, not before."""
    await masks.compile('root ::= "warm"')
    killed = masks.killed
    slow = json_schema_grammar(optional_properties(3000, "cancel"))
    first, second = (asyncio.create_task(masks.compile(slow)) for _ in range(2))
    while masks.trials_running == 0:
        await asyncio.sleep(0.02)
    first.cancel()
    await asyncio.sleep(0.3)
    assert masks.killed == killed and not second.done()  # the second still waits for it
    assert masks.trials_running == 1  # one compile for both
    second.cancel()
    for task in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await task
    deadline = time.monotonic() + 5
    while masks.killed == killed and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert masks.killed == killed + 1


async def test_a_grammar_compiles_once_and_a_bad_one_says_why(masks, monkeypatch):
    from agentrl.engine.grammar_worker import TrialWorkers

    trials = []
    real = TrialWorkers.trial
    monkeypatch.setattr(TrialWorkers, "trial",
                        lambda self, *a: trials.append(1) or real(self, *a))
    ebnf = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})
    first, again = await masks.compile(ebnf), await masks.compile(ebnf)
    assert first is again and trials == [1]
    with pytest.raises(GrammarError, match="cannot be compiled: .*parser error"):
        await masks.compile("root ::= (")
    assert await masks.compile('root ::= "fine"')
