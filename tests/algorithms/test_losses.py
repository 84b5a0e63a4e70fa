"""Policy/value losses, aggregation and logit helpers against loops and hand examples."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from agentrl.algorithms import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate_loss,
    entropy_from_logits,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    register_policy_loss,
    value_loss,
)
from agentrl.algorithms import losses as losses_module

from ._batches import make_batch


def _reference_ppo(
    logp: Tensor,
    old: Tensor,
    adv: Tensor,
    mask: Tensor,
    low: float,
    high: float,
    dual: float | None,
) -> tuple[list[list[float]], float]:
    """Token loop: loss per token and the clip ratio over action tokens."""
    loss = [[0.0] * logp.shape[1] for _ in range(logp.shape[0])]
    clipped = count = 0
    for b, t, ratio in _action_ratios(logp, old, mask):
        a = float(adv[b, t])
        s1, s2 = ratio * a, min(max(ratio, 1 - low), 1 + high) * a
        value = min(s1, s2)
        if dual is not None and a < 0:
            value = max(value, dual * a)
        loss[b][t] = -value
        clipped += s2 < s1
        count += 1
    return loss, clipped / count


def _action_ratios(logp: Tensor, old: Tensor, mask: Tensor) -> Iterator[tuple[int, int, float]]:
    """(row, position, importance ratio clamped as the losses clamp it) of each action token,
    one by one: what the reference loops below compute from."""
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t]:
                yield b, t, math.exp(min(max(float(logp[b, t] - old[b, t]), -20.0), 20.0))


def _random_policy_inputs(seed: int) -> dict[str, Tensor]:
    batch = make_batch(seed)
    old = batch.logp_BT
    return {
        "logp_BT": old + 0.3 * torch.randn_like(old),
        "old_logp_BT": old,
        "advantages_BT": torch.randn_like(old) * batch.mask_BT,
        "mask_BT": batch.mask_BT,
    }


@pytest.mark.parametrize(
    ("low", "high", "dual"), [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_matches_reference(seed: int, low: float, high: float, dual: float | None) -> None:
    inputs = _random_policy_inputs(seed)
    loss, metrics = policy_loss("ppo", clip_low=low, clip_high=high, dual_clip=dual, **inputs)
    want, clip_ratio = _reference_ppo(
        inputs["logp_BT"],
        inputs["old_logp_BT"],
        inputs["advantages_BT"],
        inputs["mask_BT"],
        low,
        high,
        dual,
    )
    torch.testing.assert_close(loss, torch.tensor(want))
    assert 0 < clip_ratio < 1
    torch.testing.assert_close(metrics["clip_ratio"], torch.tensor(clip_ratio))
    mask = inputs["mask_BT"]
    kl = float(((inputs["old_logp_BT"] - inputs["logp_BT"]) * mask).sum() / mask.sum())
    torch.testing.assert_close(metrics["approx_kl"], torch.tensor(kl))


def test_ppo_clip_higher_and_dual_clip_by_hand() -> None:
    mask = torch.ones(1, 3)
    # ratios 1.25, 1.25, 5; advantages +1, +1, -1.
    logp = torch.log(torch.tensor([[1.25, 1.25, 5.0]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    kwargs = {"logp_BT": logp, "old_logp_BT": old, "advantages_BT": adv, "mask_BT": mask}
    loss, metrics = policy_loss("ppo", **kwargs)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.2, 5.0]]))
    torch.testing.assert_close(metrics["clip_ratio"], torch.tensor(2 / 3))
    loss, _ = policy_loss("ppo", clip_high=0.28, **kwargs)
    torch.testing.assert_close(loss, torch.tensor([[-1.25, -1.25, 5.0]]))
    loss, metrics = policy_loss("ppo", dual_clip=3.0, **kwargs)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.2, 3.0]]))
    torch.testing.assert_close(metrics["dual_clip_ratio"], torch.tensor(1 / 3))


def test_gspo_uses_the_sequence_ratio_and_its_own_clip_defaults() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(2, 3)
    # Row 0: geometric mean ratio exp((0.002 - 0.001) / 2) = exp(5e-4): clipped at 1 + 4e-4.
    # Row 1: exp(0) = 1 with token deviations that a token-level PPO would see.
    logp = torch.tensor([[0.002, -0.001, 7.0], [0.1, -0.1, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    loss, metrics = policy_loss(
        "gspo", logp_BT=logp, old_logp_BT=old, advantages_BT=adv, mask_BT=mask
    )
    torch.testing.assert_close(loss, torch.tensor([[-1.0004, -1.0004, 0.0], [2.0, 2.0, 2.0]]))
    torch.testing.assert_close(metrics["clip_ratio"], torch.tensor(2 / 5))


def test_gspo_gradient_equals_the_sequence_level_objective() -> None:
    inputs = _random_policy_inputs(2)
    mask = inputs["mask_BT"]
    seq_adv = torch.randn(mask.shape[0])
    logp = inputs["logp_BT"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        "gspo",
        logp_BT=logp,
        old_logp_BT=inputs["old_logp_BT"],
        advantages_BT=seq_adv[:, None] * mask,
        mask_BT=mask,
        clip_low=0.05,
        clip_high=0.05,
    )
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "seq-mean-token-mean"), logp)
    # Paper eq. 5, one sequence at a time.
    logp_ref = inputs["logp_BT"].clone().requires_grad_(True)
    total = torch.zeros(())
    for b in range(mask.shape[0]):
        sel = mask[b] != 0
        s = torch.exp((logp_ref[b][sel] - inputs["old_logp_BT"][b][sel]).mean())
        total = total - torch.min(s * seq_adv[b], s.clamp(0.95, 1.05) * seq_adv[b])
    (want,) = torch.autograd.grad(total / mask.shape[0], logp_ref)
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, want)


def _reference_cispo(
    logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, low: float, high: float
) -> tuple[list[list[float]], list[list[float]], float]:
    """Token loop of MiniMax-M1 eq. 4: per token the loss -w A logp, its derivative in logp
    (-w A, the weight being stop-gradient) and the share of action tokens whose weight clipped."""
    loss = [[0.0] * logp.shape[1] for _ in range(logp.shape[0])]
    dloss = [[0.0] * logp.shape[1] for _ in range(logp.shape[0])]
    clipped = count = 0
    for b, t, ratio in _action_ratios(logp, old, mask):
        weight = min(max(ratio, 1 - low), 1 + high)
        loss[b][t] = -weight * float(adv[b, t]) * float(logp[b, t])
        dloss[b][t] = -weight * float(adv[b, t])
        clipped += weight != ratio
        count += 1
    return loss, dloss, clipped / count


@pytest.mark.parametrize(
    ("low", "high"),
    # None: the defaults (1, 3): no lower bound, as in the paper; then ranges that bind.
    [(None, None), (0.2, 0.28), (1.0, 0.1), (0.1, 3.0)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_matches_reference(seed: int, low: float | None, high: float | None) -> None:
    inputs = _random_policy_inputs(seed)
    logp = inputs["logp_BT"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        "cispo", clip_low=low, clip_high=high, **{**inputs, "logp_BT": logp}
    )
    mask = inputs["mask_BT"]
    want, dwant, clip_ratio = _reference_cispo(
        inputs["logp_BT"], inputs["old_logp_BT"], inputs["advantages_BT"], mask,
        1.0 if low is None else low, 3.0 if high is None else high,
    )
    torch.testing.assert_close(loss, torch.tensor(want))
    # The paper's token-mean: the gradient is -w A / N_tokens on every action token.
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "token-mean"), logp)
    torch.testing.assert_close(grad, torch.tensor(dwant) / mask.sum())
    torch.testing.assert_close(metrics["clip_ratio"], torch.tensor(clip_ratio))
    assert (clip_ratio == 0) == (low is None), clip_ratio  # 0.3-sigma ratios stay below 4
    kl = float(((inputs["old_logp_BT"] - inputs["logp_BT"]) * mask).sum() / mask.sum())
    torch.testing.assert_close(metrics["approx_kl"], torch.tensor(kl))


def test_cispo_keeps_the_gradient_that_ppo_clips_by_hand() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # Ratios 1.5 (A > 0), 0.5 (A < 0) and 10 (A > 0): outside PPO's [0.8, 1.2], so PPO's min
    # takes the constant clipped term and their gradient is 0; CISPO bounds only the weight.
    old = torch.log(torch.tensor([[0.4, 0.2, 0.01, 0.5]]))
    logp = (old + torch.log(torch.tensor([[1.5, 0.5, 10.0, 1.0]])))
    adv = torch.tensor([[2.0, -1.0, 1.0, 5.0]])
    kwargs = {"old_logp_BT": old, "advantages_BT": adv, "mask_BT": mask}
    grads = {}
    for name, high in (("ppo", 0.2), ("cispo", None)):
        x = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(name, logp_BT=x, clip_high=high, **kwargs)
        (grads[name],) = torch.autograd.grad(loss.sum(), x)
        if name == "cispo":
            # Weights sg(clip(r, 0, 4)) = 1.5, 0.5, 4: loss -w A logp with logp = log 0.6, 0.1, 0.1.
            want = [-1.5 * 2.0 * math.log(0.6), 0.5 * math.log(0.1), -4.0 * math.log(0.1), 0.0]
            torch.testing.assert_close(loss, torch.tensor([want]))
            torch.testing.assert_close(metrics["clip_ratio"], torch.tensor(1 / 3))
    torch.testing.assert_close(grads["ppo"], torch.zeros(1, 4))
    torch.testing.assert_close(grads["cispo"], torch.tensor([[-3.0, 0.5, -4.0, 0.0]]))


@pytest.mark.parametrize(
    ("low", "high", "match"),
    [
        (0.0, 0.0, r"\[1, 1\], which is empty"),
        (-0.5, 0.2, r"\[1.5, 1.2\], which is inverted"),
        (2.0, -1.5, r"\[-1, -0.5\], which leaves out the on-policy weight 1"),
        (float("nan"), 3.0, r"\[nan, 4\], which has no bound \(NaN\)"),
    ],
)
def test_cispo_refuses_an_empty_or_inverted_clip_range(
    low: float, high: float, match: str
) -> None:
    ones = torch.ones(2, 3)
    kwargs = {"logp_BT": ones, "old_logp_BT": ones, "advantages_BT": ones, "mask_BT": ones}
    with pytest.raises(ValueError, match=rf"clip_low={low:g} and clip_high={high:g} give CISPO "
                                         rf"the clip range .* = {match}.*; use clip_low >= 0"):
        policy_loss("cispo", clip_low=low, clip_high=high, **kwargs)


def test_cispo_refuses_a_dual_clip() -> None:
    ones = torch.ones(2, 3)
    kwargs = {"logp_BT": ones, "old_logp_BT": ones, "advantages_BT": ones, "mask_BT": ones}
    with pytest.raises(ValueError, match="dual_clip=3 bounds PPO's .* leave dual_clip unset"):
        policy_loss("cispo", dual_clip=3.0, **kwargs)


def _reference_aggregate(
    loss: Tensor, mask: Tensor, mode: str, n_tok: float, n_seq: float, constant: float | None
) -> float:
    total = 0.0
    for b in range(loss.shape[0]):
        tokens = [float(loss[b, t]) for t in range(loss.shape[1]) if mask[b, t]]
        if mode == "seq-mean-token-mean":
            total += sum(tokens) / len(tokens) if tokens else 0.0
        else:
            total += sum(tokens)
    if mode == "token-mean":
        return total / n_tok
    return total / n_seq / (constant if mode == "constant" else 1.0)


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
def test_aggregate_loss_matches_reference(mode: str) -> None:
    batch = make_batch(3)
    mask = batch.mask_BT.clone()
    mask[0] = 0.0  # a sequence without action tokens counts in no denominator
    loss = torch.randn_like(mask)
    constant = 16.0 if mode == "constant" else None
    got = aggregate_loss(loss, mask, mode, constant=constant)
    n_tok, n_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())
    want = _reference_aggregate(loss, mask, mode, n_tok, n_seq, constant)
    torch.testing.assert_close(got, torch.tensor(want))


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
def test_aggregation_is_invariant_to_micro_batch_split(mode: str) -> None:
    batch = make_batch(8, group_sizes=(4, 4, 4, 4))
    mask = batch.mask_BT
    weights = torch.randn_like(mask)
    constant = 24.0 if mode == "constant" else None
    n_tok, n_seq = mask.sum(), (mask.sum(1) > 0).sum()
    results = []
    for num_micro in (1, 2, 4):
        params = torch.zeros_like(mask, requires_grad=True)
        total = torch.zeros(())
        for rows in torch.arange(mask.shape[0]).chunk(num_micro):
            per_token = (params[rows] - weights[rows]) ** 2
            total = total + aggregate_loss(
                per_token, mask[rows], mode, num_tokens=n_tok, num_seqs=n_seq, constant=constant
            )
        total.backward()
        results.append((total.detach(), params.grad))
    for total, grad in results[1:]:
        torch.testing.assert_close(total, results[0][0])
        torch.testing.assert_close(grad, results[0][1])
    # Local counts would not be invariant for token-mean.
    if mode == "token-mean":
        halves = [aggregate_loss(weights[r] ** 2, mask[r], mode) for r in torch.arange(16).chunk(2)]
        assert not torch.isclose(sum(halves), results[0][0])


def test_value_loss_matches_reference_and_hand_example() -> None:
    values = torch.tensor([[1.0, 2.0, 0.0, 3.0]])
    old = torch.tensor([[0.0, 2.5, 0.0, 3.0]])
    returns = torch.tensor([[1.0, 1.0, 9.0, 3.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    # t0: clipped 0.5 -> max(0.25, 0) / 2; t1: clipped 2.0 = V -> 1 / 2; t3: 0.25 / 2.
    torch.testing.assert_close(
        value_loss(values, old, returns, mask), torch.tensor([[0.125, 0.5, 0.0, 0.125]])
    )
    torch.testing.assert_close(
        value_loss(values, old, returns, mask, clip=None), torch.tensor([[0.0, 0.5, 0.0, 0.125]])
    )
    batch = make_batch(1)
    v = batch.values_BT
    v_old, ret = v + torch.randn_like(v), torch.randn_like(v)
    want = [
        [
            0.5
            * max((float(o) + min(max(float(a - o), -0.5), 0.5) - float(r)) ** 2, float(a - r) ** 2)
            * float(m)
            for a, o, r, m in zip(*rows)
        ]
        for rows in zip(v, v_old, ret, batch.mask_BT)
    ]
    torch.testing.assert_close(value_loss(v, v_old, ret, batch.mask_BT), torch.tensor(want))


def test_logprobs_and_entropy_match_reference_loops() -> None:
    logits = torch.randn(2, 3, 5)
    labels = torch.randint(0, 5, (2, 3))
    for temperature in (1.0, 0.7):
        want_logp, want_entropy = [[0.0] * 3 for _ in range(2)], [[0.0] * 3 for _ in range(2)]
        for b in range(2):
            for t in range(3):
                z = [float(v) / temperature for v in logits[b, t]]
                norm = math.log(sum(math.exp(v) for v in z))
                want_logp[b][t] = z[int(labels[b, t])] - norm
                want_entropy[b][t] = -sum(math.exp(v - norm) * (v - norm) for v in z)
        got = logprobs_from_logits(logits, labels, temperature=temperature)
        torch.testing.assert_close(got, torch.tensor(want_logp))
        got = entropy_from_logits(logits, temperature=temperature)
        torch.testing.assert_close(got, torch.tensor(want_entropy))


def test_logprobs_from_bf16_logits_are_float32_with_full_gradient() -> None:
    logits = torch.randn(3, 4, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 4))
    logp = logprobs_from_logits(logits, labels, temperature=0.5)
    full = torch.log_softmax(logits / 0.5, -1).gather(-1, labels[..., None]).squeeze(-1)
    g1 = torch.autograd.grad(logp.sum(), logits)[0]
    g2 = torch.autograd.grad(full.sum(), logits)[0]
    torch.testing.assert_close(g1, g2)
    bf16 = logprobs_from_logits(logits.detach().bfloat16(), labels)
    assert bf16.dtype == torch.float32 and bf16.shape == (3, 4)
    assert entropy_from_logits(logits.detach().bfloat16()).dtype == torch.float32


def _reference_logp_entropy(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """``[logp, H]`` in float64 through the textbook formulas, differentiable by autograd."""
    z = logits.double() / temperature
    logp_v = torch.log_softmax(z, -1)
    logp = logp_v.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(logp_v.exp() * logp_v).sum(-1)
    return torch.stack([logp, entropy])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("used", [("logp", "entropy"), ("logp",), ("entropy",)])
def test_logprobs_and_entropy_values_and_gradients_match_float64(
    temperature: float, used: tuple[str, ...]
) -> None:
    """Against float64 autograd, with a loss on both outputs or on one (an output left out of
    the loss, like the entropy as a logged metric, gets no gradient at all)."""
    logits = (3 * torch.randn(3, 4, 9)).requires_grad_()
    labels = torch.randint(0, 9, (3, 4))
    logp, entropy = logprobs_and_entropy_from_logits(logits, labels, temperature)
    assert logp.dtype == entropy.dtype == torch.float32
    ref = _reference_logp_entropy(logits, labels, temperature)
    torch.testing.assert_close(logp, ref[0].float())
    torch.testing.assert_close(entropy, ref[1].float())
    outputs = {"logp": (logp, ref[0]), "entropy": (entropy, ref[1])}
    weights = {name: torch.randn(3, 4) for name in used}
    (got,) = torch.autograd.grad(sum((weights[k] * outputs[k][0]).sum() for k in used), logits)
    (want,) = torch.autograd.grad(sum((weights[k] * outputs[k][1]).sum() for k in used), logits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


def test_logprobs_and_entropy_pass_gradcheck_in_float64() -> None:
    logits = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (2, 3))
    for temperature in (1.0, 0.6):
        assert torch.autograd.gradcheck(
            lambda x, t=temperature: logprobs_and_entropy_from_logits(x, labels, t), (logits,)
        )
        assert torch.autograd.gradcheck(
            lambda x, t=temperature: entropy_from_logits(x, temperature=t), (logits,)
        )


def test_logprobs_and_entropy_of_bf16_logits_are_those_of_their_float32_values() -> None:
    """bf16 logits are upcast, not computed in bf16; their gradient is the float32 one, rounded."""
    logits = torch.randn(2, 5, 33).bfloat16()
    labels = torch.randint(0, 33, (2, 5))
    w = torch.randn(2, 2, 5)
    grads, outs = [], []
    for x in (logits.clone().requires_grad_(), logits.float().requires_grad_()):
        out = torch.stack(logprobs_and_entropy_from_logits(x, labels, 0.8))
        grads.append(torch.autograd.grad((w * out).sum(), x)[0])
        outs.append(out)
    assert outs[0].dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], grads[1].bfloat16(), rtol=0, atol=0)


def test_logprobs_and_entropy_without_gradients_equal_the_public_functions() -> None:
    logits, labels = torch.randn(2, 4, 10), torch.randint(0, 10, (2, 4))
    with torch.no_grad():
        logp, entropy = logprobs_and_entropy_from_logits(logits, labels, 0.9)
    with_grad = logprobs_and_entropy_from_logits(logits.requires_grad_(), labels, 0.9)
    torch.testing.assert_close(logp, logprobs_from_logits(logits, labels, 0.9), rtol=0, atol=0)
    torch.testing.assert_close(entropy, entropy_from_logits(logits, temperature=0.9))
    torch.testing.assert_close(with_grad[0], logp, rtol=0, atol=0)
    torch.testing.assert_close(with_grad[1], entropy, rtol=0, atol=0)


def test_register_policy_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(losses_module, "POLICY_LOSSES", dict(POLICY_LOSSES))

    def vanilla_pg(
        *, logp_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor, **_: object
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return -logp_BT * advantages_BT * mask_BT, {}

    register_policy_loss("pg", vanilla_pg)
    ones = torch.ones(1, 2)
    loss, _ = policy_loss(
        "pg", logp_BT=-ones, old_logp_BT=ones, advantages_BT=2 * ones, mask_BT=ones
    )
    torch.testing.assert_close(loss, 2 * ones)
    with pytest.raises(ValueError, match="policy loss named 'pg' is already registered"):
        register_policy_loss("pg", vanilla_pg)


def test_error_messages() -> None:
    ones = torch.ones(2, 3)
    kwargs = {"logp_BT": ones, "old_logp_BT": ones, "advantages_BT": ones, "mask_BT": ones}
    with pytest.raises(ValueError, match="Unknown policy loss 'gpso'.*Did you mean 'gspo'"):
        policy_loss("gpso", **kwargs)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss("ppo", dual_clip=0.5, **kwargs)
    with pytest.raises(ValueError, match="0 <= clip_low < 1"):
        policy_loss("ppo", clip_low=1.5, **kwargs)
    with pytest.raises(ValueError, match=r"mask_BT must have the shape of logp_BT \(2, 3\)"):
        policy_loss("ppo", **{**kwargs, "mask_BT": torch.ones(2, 2)})
    with pytest.raises(
        ValueError, match="Unknown loss aggregation mode 'token_mean'.*'token-mean'"
    ):
        aggregate_loss(ones, ones, "token_mean")
    with pytest.raises(ValueError, match="'constant' needs constant > 0"):
        aggregate_loss(ones, ones, "constant")
    with pytest.warns(UserWarning, match="constant=8 is ignored"):
        aggregate_loss(ones, ones, "token-mean", constant=8)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_from_logits(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), 0.0)
