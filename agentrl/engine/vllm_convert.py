"""What crosses between agentrl's types and vLLM 0.32's: sampling parameters going in,
`CompletionOutput`s coming back as `Completion`s and streamed `CompletionDelta`s, and the weight
version that sampled each token.

vLLM labels every step's outputs with the engine's weight version (`update_weight_version`,
which agentrl.engine.vllm_engine sets to agentrl's version at start and at every update). A
finished `CompletionOutput.weight_versions` holds the spans of tokens each version sampled; a
streamed delta reads the same spans as vLLM's output processor records them
(`RequestState.weight_version_starts`), so every token carries the version that sampled it and
that version's log-prob (`Completion.version_changes`).

vLLM is imported inside the functions that need it: this module loads without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.completion import (
    Completion,
    CompletionDelta,
    SamplingParams,
    expand_versions,
    shift_version_changes,
)


def to_vllm_params(params: SamplingParams, output_kind: Any) -> Any:
    """`params` as vLLM's `SamplingParams`, with `output_kind` (a `RequestOutputKind`)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    want = max(params.top_logprobs, 0)
    return VSamplingParams(
        n=1 if greedy_copies(params) else params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),
        max_tokens=params.max_tokens,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        seed=params.seed,
        logprobs=want if params.logprobs or want else None,
        logit_bias=dict(params.logit_bias) or None,
        # vLLM's xgrammar backend masks the logits before its sampler, as ours does.
        structured_outputs=None if params.grammar is None
        else StructuredOutputsParams(grammar=params.grammar),
        output_kind=output_kind,
    )


def greedy_copies(params: SamplingParams) -> bool:
    """vLLM refuses n > 1 with greedy sampling; its n completions would be equal, so the engine
    asks for one and copies it (as the transformers engine returns n equal rows)."""
    return params.temperature == 0 and params.n > 1


def _tokens(out: Any, params: SamplingParams) -> tuple[list[int], list[float] | None, Any]:
    """Token ids, their logprobs (if asked for) and top logprobs (if asked for) of an output."""
    ids = [int(t) for t in out.token_ids]
    lps = top = None
    if out.logprobs is not None:
        lps = [float(d[t].logprob) for t, d in zip(ids, out.logprobs, strict=True)]
        if params.top_logprobs:
            top = [
                sorted(((int(k), float(v.logprob)) for k, v in d.items()), key=lambda kv: -kv[1])[
                    : params.top_logprobs
                ]
                for d in out.logprobs
            ]
    return ids, lps if params.logprobs else None, top


def _finish(out: Any) -> Any:
    if out.finish_reason is None:
        return None
    return out.finish_reason if out.finish_reason in ("stop", "length", "abort") else "abort"


Versions = tuple[int, list[tuple[int, int]]]
"""The version of a completion's first token and its changes, as `Completion` holds them."""


def version_spans(spans: Sequence[Any] | None, n: int, default: int) -> Versions:
    """vLLM's `WeightVersionSpan`s of a finished output (token ranges each weight version
    sampled) as agentrl's first version and changes; `default` where vLLM has no labels."""
    return _versions([(s.version, s.start) for s in spans or ()], n, default)


def _versions(starts: Sequence[tuple[str, int]], n: int, default: int) -> Versions:
    """(label, first token index) pairs, in order, as (first version, changes) over n tokens.
    Labels are agentrl's versions as strings (`update_weight_version`); a label that is not
    (another client's) leaves the tokens with the version before it."""
    first, changes = default, list[tuple[int, int]]()
    for label, start in starts:
        try:
            v = int(label)
        except ValueError:
            continue
        if start <= 0:
            first, changes = v, []
        elif start < n and v != (changes[-1][1] if changes else first):
            changes.append((start, v))
    return first, changes


class StreamLabels:
    """Per-token versions of a streamed request's choices, read from vLLM's output processor
    as each delta arrives: the state of a choice holds `weight_version_starts`, the (label,
    token index) where each version began. Read on the vLLM loop right after the delta is
    taken, so the state covers at least the delta's tokens (a state vLLM has removed belongs to
    a finished choice, whose output carries the spans itself)."""

    def __init__(self, processor: Any, request_id: str, version: int) -> None:
        self._processor = processor
        self._rid = request_id
        self._seen: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._default = version

    def of_delta(self, out: Any) -> Versions:
        """The versions of `out`'s new tokens (a DELTA `CompletionOutput`)."""
        index, k = int(out.index), len(out.token_ids)
        start = self._seen.get(index, 0)
        end = start + k
        last = self._last.get(index, self._default)
        if out.weight_versions is not None:
            first, changes = version_spans(out.weight_versions, end, last)
        else:
            first, changes = _versions(self._starts(index), end, last)
        self._seen[index] = end
        before, inside = shift_version_changes(changes, start, end)
        first = first if before is None else before
        self._last[index] = expand_versions(first, inside, k)[-1] if k else first
        return first, inside

    def _starts(self, index: int) -> list[tuple[str, int]]:
        processor = self._processor
        for internal in processor.external_req_ids.get(self._rid, ()):
            state = processor.request_states.get(internal)
            if state is not None and state.request_index == index:
                return list(state.weight_version_starts)
        return []


def score_from_prompt_logprobs(out: Any, ids: Sequence[int], start: int) -> list[float]:
    """The log-probs of `ids[start:]` from a `RequestOutput` of the prompt `ids` with
    `prompt_logprobs=0` (per position None, then a dict holding at least the prompt's own
    token id -> `Logprob`). A vision-language prompt is the one vLLM expanded its
    placeholders into, which must be `ids` again (`VLLMEngine._prompt`)."""
    if out is None or out.prompt_logprobs is None:
        raise RuntimeError("vLLM returned no prompt logprobs (the scoring request was aborted)")
    got = [int(t) for t in out.prompt_token_ids or ()]
    if got != list(ids):
        raise RuntimeError(f"vLLM scored another sequence than it was given ({len(got)} tokens, "
                           f"{len(ids)} sent): its image expansion differs from agentrl's")
    return [float(out.prompt_logprobs[i][ids[i]].logprob) for i in range(start, len(ids))]


def to_completion(out: Any, params: SamplingParams, versions: Versions) -> Completion:
    """A finished `CompletionOutput` as a `Completion`."""
    ids, lps, top = _tokens(out, params)
    return Completion(
        token_ids=ids,
        logprobs=lps,
        finish_reason=_finish(out) or "abort",
        policy_version=versions[0],
        stop_reason=out.stop_reason,
        top_logprobs=top,
        version_changes=versions[1],
    )


def to_delta(out: Any, params: SamplingParams, versions: Versions) -> CompletionDelta:
    """A DELTA-kind `CompletionOutput` (the tokens new since the last one) as a delta."""
    ids, lps, top = _tokens(out, params)
    finish = _finish(out)
    return CompletionDelta(
        index=int(out.index),
        token_ids=ids,
        logprobs=lps,
        top_logprobs=top,
        finish_reason=finish,
        policy_version=versions[0],
        stop_reason=out.stop_reason if finish is not None else None,
        version_changes=tuple(versions[1]),
    )
