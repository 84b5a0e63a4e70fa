"""Typed configuration for `agentrl train`. The CLI flags are generated from these dataclasses
(`--actor.lr`, `--algo.estimator`, `--rollout.n_samples_per_prompt`, ...); presets are Python
functions in `trainers/presets.py`. Every check that can fail runs before any model loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

from agentrl.command_line import EngineOptions, SamplingOptions, validation_deferred

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")
logger = logging.getLogger(__name__)

GROUP_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "gigpo", "rtg_turn")
STEP_ESTIMATORS = ("gigpo", "rtg_turn")
"""Estimators that need each turn's end (the batch's state ids, on each turn's last token)."""


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    """The policy model and its optimizer."""

    model: str = "smollm2-135m-instruct"
    """Model name (smollm2-135m-instruct, tiny) or a local Hugging Face model directory."""
    device: str = "auto"
    """Where the policy, reference and critic train: auto (cuda when a GPU is visible, else
    cpu), cpu, cuda or cuda:N."""
    lr: float = 1e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    gradient_checkpointing: bool = False
    """Trade compute for memory in the policy forward/backward."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights, gradients and optimizer state. bfloat16 halves their memory but
    loses small updates (a weight near 1 cannot move by less than ~4e-3): prefer
    --actor.mixed_precision bf16."""
    mixed_precision: Literal["no", "bf16"] = "no"
    """bf16: forward and backward under bfloat16 autocast while weights, gradients and
    optimizer state stay float32 (the usual GPU setting; also ~2x faster matmuls on CPUs with
    AMX/AVX512-BF16). Logprobs and losses are computed in float32. The sampler is unaffected."""

    lora_rank: int = 0
    """LoRA (peft): train rank-r adapters on a frozen base (0: train every weight). The
    reference model of RL and DPO is then the base with the adapters off: no second copy."""
    lora_alpha: int = 16
    """LoRA scale numerator (the adapters' update is scaled by alpha / rank)."""
    lora_targets: tuple[str, ...] = ()
    """Module names to adapt, e.g. q_proj v_proj (default: every linear layer but the head)."""
    lora_dropout: float = 0.0
    load_in_4bit: bool = False
    """QLoRA: keep the frozen base's linear layers in 4 bits (NF4, bitsandbytes: CUDA GPUs and
    CPUs with AVX2); needs lora_rank. The layers compute in --actor.dtype (bf16 under
    --actor.mixed_precision bf16); memory-bound runs add --actor.gradient_checkpointing."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        from agentrl.backends.device import check_device_name

        check_device_name(self.device, "--actor.device")
        if self.lr <= 0:
            raise ValueError(f"--actor.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ValueError("--actor.warmup_steps and --actor.max_grad_norm must be >= 0")
        if self.lora_rank < 0 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise ValueError("--actor.lora_rank must be >= 0, --actor.lora_alpha > 0 and "
                             "--actor.lora_dropout in [0, 1)")
        if self.load_in_4bit and self.lora_rank == 0:
            raise ValueError("--actor.load_in_4bit (QLoRA) trains adapters on the 4-bit base: "
                             "set --actor.lora_rank too (e.g. 16)")
        if self.mixed_precision == "bf16" and self.dtype != "float32":
            raise ValueError(
                "--actor.mixed_precision bf16 computes in bf16 over float32 weights; it needs "
                f"--actor.dtype float32, got --actor.dtype {self.dtype}"
            )


def check_sharded_4bit(actor: ActorConfig, backend: str, zero_stage: int, flag: str) -> None:
    """ValueError for QLoRA whose 4-bit base would be sharded over the ranks of `flag`: FSDP2
    and ZeRO-3 split every weight, and bitsandbytes' packed 4-bit weights (their quantization
    state kept beside them) cannot be split and gathered back. ZeRO-1 and 2 keep the base whole
    on each rank and shard only what trains (the adapters' gradients and optimizer state)."""
    sharded = backend == "fsdp2" or (backend == "deepspeed" and zero_stage == 3)
    if actor.load_in_4bit and sharded:
        how = "--backend fsdp2" if backend == "fsdp2" else "--backend deepspeed --zero_stage 3"
        raise ValueError(f"--actor.load_in_4bit (QLoRA) with {flag} > 1: {how} shards every "
                         f"weight, and the 4-bit base cannot be sharded; use --backend "
                         f"deepspeed --zero_stage 2 (the base whole on each rank, the adapters' "
                         f"gradients and optimizer state sharded) or one worker")


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """Advantages, policy loss, KL, corrections. Names follow OpenRLHF."""

    estimator: str = "group_norm"
    """Advantage estimator: gae (PPO), reinforce (REINFORCE++), reinforce_baseline, group_norm
    (GRPO), dr_grpo, rloo, gigpo (GRPO plus step-level credit among the steps a group took from
    the same state: agentrl.algorithms.gigpo, agentrl.anchors), rtg_turn (each turn's
    reward-to-go against the same turn of the group's other episodes: for multi-turn envs with
    per-step rewards)."""
    policy_loss: str = "ppo"
    """Policy loss: ppo (clip, clip-higher, dual clip), gspo (sequence ratio) or cispo (the
    clipped ratio as a stop-gradient weight on REINFORCE, MiniMax-M1)."""
    clip_low: float | None = None
    """Lower clip epsilon: ratios below 1 - clip_low are clipped. None: the loss's own default
    (ppo 0.2, gspo 3e-4, cispo 1 = no lower bound, as in the CISPO paper)."""
    clip_high: float | None = None
    """Upper clip epsilon: ratios above 1 + clip_high are clipped (above clip_low: DAPO's
    clip-higher). None: the loss's own default (ppo 0.2, gspo 4e-4, cispo 3)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None disables; ppo and gspo)."""
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"
    ] = "token-mean"
    """Loss aggregation; `constant` divides by max new tokens (the real Dr. GRPO)."""
    gamma: float = 1.0
    """Discount (group estimators force 1; rtg_turn discounts per turn)."""
    lam: float = 0.95
    """GAE lambda."""
    step_weight: float = 1.0
    """gigpo: omega, the weight of the step-level advantage added to the episode's."""
    step_gamma: float = 0.95
    """gigpo: the discount of the step-level returns G_t = sum_k step_gamma^k r_{t+k}."""
    kl_coef: float = 0.0
    """KL coefficient against the reference model (0 = no reference model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator."""
    kl_as_loss: bool = False
    """Put KL in the loss instead of shaping the reward."""
    kl_target: float | None = None
    """Adaptive KL: target KL per token (None = fixed coefficient)."""
    kl_horizon: int = 10000
    """Adaptive KL horizon."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    mismatch_correction: Literal["none", "tis", "icepop", "seq-mask-tis"] = "none"
    """Sampler/trainer mismatch correction."""
    value_clip: float = 0.5
    """PPO value-loss clip."""
    critic_lr: float = 1e-5
    """Critic learning rate (gae only)."""
    critic_init: str | None = None
    """Start the PPO critic (gae) from a reward model trained by `agentrl rm` (its
    RUN_DIR/reward_model; same tokenizer as the policy) instead of the policy with a zero head."""
    overlong_buffer: int = 0
    """DAPO overlong penalty buffer in tokens (0 = off)."""
    overlong_factor: float = 1.0
    """DAPO overlong penalty factor."""
    truncation_penalty: float | None = None
    """ProRL truncation penalty: >= 0 scales, < 0 replaces the reward of truncated episodes."""
    dynamic_filter: Literal["none", "mean", "std"] = "none"
    """DAPO dynamic filtering of groups: mean in (0, 1), or std > 0."""
    teacher: str | None = None
    """On-policy distillation: a teacher model (a name, a model directory, a trained RUN_DIR/hf)
    sharing the policy's tokenizer, run by --rollout.engine, scores every sampled token; its
    log-prob less the student's (the negative reverse-KL estimate) is the token's advantage
    (agentrl.algorithms.distillation)."""
    teacher_coef: float = 1.0
    """With --algo.teacher: the teacher term's weight c in (0, 1]; the advantage is c x
    (teacher - student log-prob) + (1 - c) x the env reward's advantage by --algo.estimator
    (1: pure distillation, the env reward only measured)."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        from agentrl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

        # The registries, not fixed lists: estimators and losses users register work too.
        _check_name("--algo.estimator", self.estimator, tuple(ADVANTAGE_ESTIMATORS))
        _check_name("--algo.policy_loss", self.policy_loss, tuple(POLICY_LOSSES))
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"--algo.dual_clip must be > 1, got {self.dual_clip}")
        if self.policy_loss == "cispo":
            from agentrl.algorithms import check_cispo_clip

            check_cispo_clip(self.clip_low, self.clip_high,
                             names=("--algo.clip_low", "--algo.clip_high"))
            if self.dual_clip is not None:
                raise ValueError("--algo.dual_clip bounds ppo's and gspo's clipped surrogate; "
                                 "cispo has no such term (its weight is capped at 1 + "
                                 "--algo.clip_high): leave --algo.dual_clip unset")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("--algo.kl_coef and --algo.entropy_coef must be >= 0")
        if self.step_weight < 0 or not 0 < self.step_gamma <= 1:
            raise ValueError(f"--algo.step_weight must be >= 0 and --algo.step_gamma in (0, 1]; "
                             f"got {self.step_weight} and {self.step_gamma}")
        if self.critic_init is not None:
            from agentrl.models.value import check_reward_model

            if self.estimator != "gae":
                raise ValueError("--algo.critic_init starts PPO's critic; it needs "
                                 "--algo.estimator gae")
            check_reward_model(self.critic_init, "--algo.critic_init")
        self._check_teacher()

    def _check_teacher(self) -> None:
        if self.teacher is None:
            if self.teacher_coef != 1.0:
                logger.warning("--algo.teacher_coef %s is ignored: it weighs --algo.teacher, "
                               "which is not set", self.teacher_coef)
            return
        if not 0.0 < self.teacher_coef <= 1.0:
            raise ValueError(f"--algo.teacher_coef must be in (0, 1] (1: pure distillation), "
                             f"got {self.teacher_coef}")
        if self.teacher_coef == 1.0 and self.estimator == "gae":
            raise ValueError("--algo.teacher with --algo.teacher_coef 1 is pure distillation, "
                             "which uses no critic: drop --algo.estimator gae, or mix in the "
                             "env reward with --algo.teacher_coef below 1")
        if self.teacher_coef == 1.0 and self.kl_coef > 0 and not self.kl_as_loss:
            raise ValueError("--algo.teacher with --algo.teacher_coef 1 runs no estimator to "
                             "shape rewards with the reference KL (--algo.kl_coef): add "
                             "--algo.kl_as_loss to keep it as a loss term")

    @property
    def pure_distillation(self) -> bool:
        """A teacher alone gives the advantages: the env reward is only measured."""
        return self.teacher is not None and self.teacher_coef == 1.0


@dataclass(frozen=True, kw_only=True)
class RolloutConfig(EngineOptions, SamplingOptions):
    """How trajectories are sampled (the engine and sampling flags are eval's, rollout's and
    serve's too: agentrl.command_line)."""

    FLAGS: ClassVar[str] = "--rollout."

    n_samples_per_prompt: int = 4
    """Samples per prompt (the group size of group estimators)."""
    prompts_per_step: int = 2
    """Prompts per training step."""
    max_new_tokens: int = 32
    """Most tokens sampled per policy turn."""
    max_episode_tokens: int | None = None
    """Token budget per episode (prompt, actions, observations); the rollout loop truncates the
    episode when it runs out (info truncated_by "max_episode_tokens"). None: no limit."""
    max_turns: int | None = None
    """Turn budget per episode, for every env; the rollout loop truncates the episode after the
    last turn (info truncated_by "max_turns"). An env whose own task rule depends on its turn
    limit (math-tir: the last turn must answer) is told this budget. None: no limit."""
    max_concurrency: int = 64
    """Episodes in flight at once."""
    env_timeout_s: float | None = 300.0
    """Longest one env call (building the env, reset, step, close) may take. An episode whose
    call runs past it is abandoned (its thread left to finish, its env never used again) and
    discarded with the reason in its info, and the step goes on with the others. Sandboxed code
    has its own, shorter deadline; this one catches env code that hangs around it. None: no
    limit."""
    enable_sleep: bool = False
    """vllm on GPUs: offload the engine's weights and free its KV cache while the trainer updates
    (vLLM's CUDA sleep mode)."""
    num_engines: int = 1
    """Placed mode: engines behind one router (agentrl/engine/router.py), each with its own copy of
    the weights (and GPU); a group's episodes stay on one engine for all their turns."""
    mode: Literal["colocated", "placed"] = "colocated"
    """colocated: engine and policy share the weights in one actor (free weight sync);
    placed: a separate rollout actor that receives weights in buckets."""
    async_depth: int = 0
    """Placed mode: rollout batches sampled ahead of training (0 = strictly on-policy)."""
    weight_sync_bucket_mb: int = 64
    """Placed mode: size of each weight-sync bucket."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        if self.n_samples_per_prompt < 1 or self.prompts_per_step < 1:
            raise ValueError("--rollout.n_samples_per_prompt and prompts_per_step must be >= 1")
        EngineOptions.__post_init__(self)
        SamplingOptions.__post_init__(self)
        from agentrl.rollout.budget import check_budget, check_deadline

        check_budget(self.max_turns, "--rollout.max_turns")
        check_budget(self.max_episode_tokens, "--rollout.max_episode_tokens")
        check_deadline(self.env_timeout_s, "--rollout.env_timeout_s")
        if self.async_depth < 0:
            raise ValueError("--rollout.async_depth must be >= 0")
        if self.num_engines < 1:
            raise ValueError(f"--rollout.num_engines must be >= 1, got {self.num_engines}")
        if self.num_engines > 1 and self.mode != "placed":
            raise ValueError("--rollout.num_engines > 1 needs --rollout.mode placed (colocated, "
                             "the engine is the policy worker's own model)")
        if self.tensor_parallel_size < 1:
            raise ValueError("--rollout.tensor_parallel_size must be >= 1")
        if self.engine != "vllm" and (self.tensor_parallel_size > 1 or self.enable_sleep):
            raise ValueError("--rollout.tensor_parallel_size > 1 and --rollout.enable_sleep need "
                             "--rollout.engine vllm")
        if self.async_depth and self.mode != "placed":
            raise ValueError(
                "--rollout.async_depth > 0 needs --rollout.mode placed: colocated sampling uses "
                "the very weights being trained"
            )


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Which Ray cluster the run's actors live in."""

    address: str | None = None
    """Join this running Ray cluster instead of starting a private one: "auto" (the cluster
    `ray start` runs on this machine) or HOST:PORT (its head's GCS address, `ray start --head
    --port PORT`). Default: $RAY_ADDRESS if set, else a private local cluster. Every node
    needs the same Python environment with agentrl installed."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        a = self.address
        if a is not None and a != "auto":
            host, sep, port = a.rpartition(":")
            if not (sep and host and port.isdigit()):
                raise ValueError(f"--ray.address {a!r}: use auto, or HOST:PORT of the cluster's "
                                 f"head (e.g. 10.0.0.1:6379)")


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """Single-turn RL from a prompt file (`--dataset data.jsonl --reward_fn rewards.py:score`):
    each row's prompt is rendered by the chat template, one response sampled and scored."""

    path: str | None = None
    """A .jsonl (or .json list) of rows; `--dataset PATH` is short for --dataset.path PATH."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string (a user message) or a list of chat messages."""
    label_key: str = "label"
    """Column passed to the reward function as `label` (None where a row has none)."""
    eval_path: str | None = None
    """Held-out rows for the evaluations (default: the training file)."""
    system_prompt: str | None = None
    """A system message put before string prompts."""


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """What scores single-turn episodes instead of --reward_fn: a reward service
    (`agentrl reward-serve`) over HTTP, or a reward model trained by `agentrl rm`."""

    url: str | None = None
    """e.g. http://127.0.0.1:8001/score; instead of --reward_fn."""
    model: str | None = None
    """A reward model directory (`agentrl rm`'s RUN_DIR/reward_model), scored in its own Ray
    actor in batches; instead of --reward_fn."""
    num_gpus: float = 0.0
    """GPUs for the reward model's actor (0: it runs on the CPU)."""
    timeout_s: float = 30.0
    """Longest wait for one batch's answer."""
    retries: int = 2
    """Tries after a timeout or a 5xx; then the batch's episodes are discarded and counted."""
    max_batch: int = 64
    """Most episodes scored per request (calls within 10 ms are sent together)."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--reward.url must be an http(s) URL, got {self.url!r}")
        if self.url is not None and self.model is not None:
            raise ValueError("pass --reward.url (a reward service) or --reward.model (a reward "
                             "model), not both")
        if self.model is not None:
            from agentrl.models.value import check_reward_model

            check_reward_model(self.model, "--reward.model")
        if self.num_gpus < 0:
            raise ValueError(f"--reward.num_gpus must be >= 0, got {self.num_gpus}")
        if not self.timeout_s > 0 or self.retries < 0 or self.max_batch < 1:
            raise ValueError("--reward.timeout_s must be > 0, --reward.retries >= 0 and "
                             "--reward.max_batch >= 1")


@dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """A supervised warm-up before RL (behaviour cloning): episodes played by the env's own
    scripted policy (`ChatEnv.oracle_action`, `agentrl.rollout.scripted`), imitated with
    cross-entropy on their action tokens by the policy's optimizer (--actor.lr), then RL
    starts from the warmed-up weights. Off by default (episodes 0)."""

    episodes: int = 0
    """Scripted episodes to play (0: no warm-up). Their seeds are their own (derived from
    --seed), not the training prompts'."""
    epochs: int = 1
    """Passes over those episodes."""
    batch_size: int = 8
    """Episodes per optimizer step (split into --micro_batch_size micro-batches)."""
    env_kwargs: dict[str, object] = field(default_factory=dict)
    """Env arguments for the scripted episodes, over the training env's (e.g. other tasks
    than the training ones: MiniWoB's `{"task": "warm-up"}`)."""
    evaluate: bool = True
    """With --eval_problems: evaluate after the warm-up too (`eval_warmup`), so the run shows
    what the warm-up did and what RL added."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        if self.episodes < 0 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"--warmup.episodes must be >= 0 (0: no warm-up), --warmup.epochs "
                             f"and --warmup.batch_size >= 1; got {self.episodes}, "
                             f"{self.epochs}, {self.batch_size}")


SINGLE_TURN_ENVS = ("single-turn", "agentrl/SingleTurn-v0")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One RL run."""

    env: str = "math-tir"
    """Environment id or CLI name (see `agentrl envs`)."""
    env_kwargs: dict[str, object] = field(default_factory=dict)
    """Extra keyword arguments for the environment (JSON in --config files)."""
    eval_env_kwargs: dict[str, object] = field(default_factory=dict)
    """Keyword arguments that select the held-out split for evals (e.g. {"split": "eval"})."""
    replay: str | None = None
    """Train on recorded trajectories (a .jsonl, consumed in order, one rollout batch per step)
    instead of sampling: offline re-training, exact-resume tests, debugging."""
    agent: str | None = None
    """Train a black-box agent instead of an env: "module:function" with signature
    agent(task, base_url, api_key) (sync or async), run against the recording proxy, one
    session per episode. Needs --agent_tasks and --agent_reward."""
    agent_cmd: str | None = None
    """Train an agent that is a command, in any language: "CMD ARGS" runs once per episode
    with OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY (its session)
    and AGENTRL_SESSION_ID in its environment and its task (one JSON value) on stdin; its last
    stdout line is its answer, scored as an --agent's result. Instead of --agent."""
    agent_concurrency: int | None = None
    """Most agent episodes (for --agent_cmd, processes) running at once; default
    --rollout.max_concurrency."""
    agent_timeout_s: float = 300.0
    """An agent that sends the proxy no request for this long (none in flight) is ended (an
    --agent_cmd's process group killed); its turns are kept, discarded with the reason."""
    agent_tasks: str | None = None
    """JSON-lines file of tasks (one JSON value per line) for --agent or --agent_cmd."""
    agent_reward: str | None = None
    """"module:function" scoring reward(task, agent_result) -> float, for --agent (or
    --reward.url: a reward service scores {"prompt": task, "response": result, "label":
    task["label"]})."""
    agent_eval_tasks: str | None = None
    """JSON-lines file of held-out tasks for an agent run's evals (before and after training,
    and --eval_every): its first --eval_problems tasks, each run --eval_samples times through
    the proxy as in training and scored by the same reward; an episode is solved when its
    reward is >= 1. Without it an agent run has no evals."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_fn: str | None = None
    """With --dataset: `file.py:fn` or `package.module:fn` scoring fn(prompt, response, label)
    -> float (or {"reward": float, ...}), or a bare `file.py` defining OpenRLHF's batched
    reward_func(queries, prompts, labels)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    steps: int = 10
    """Training steps (one rollout batch each)."""
    epochs_per_step: int = 1
    """Passes over each rollout batch (PPO epochs)."""
    minibatches_per_step: int = 1
    """Optimizer steps per epoch."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (gradient accumulation; does not change the result)."""
    packing: bool = True
    """Pack each micro-batch's sequences into one row (no padding); False pads instead."""
    share_prefixes: bool = True
    """With packing, encode the prompt shared by a group's samples once per micro-batch (exact:
    same logprobs and gradients; needs an attention implementation that takes a mask: sdpa or
    eager, otherwise it is skipped)."""
    backend: str = "auto"
    """Training backend (agentrl/backends): local (one process, any device); cpu (local plus
    the CPU speed-ups measured faster on this CPU); fsdp2 (parameters, gradients and optimizer
    state sharded over --num_policy_workers Ray actors); deepspeed (ZeRO --zero_stage 1, 2 or
    3); auto = cpu on a CPU device, local on a GPU. The distributed ones need --rollout.mode
    placed; the critic (gae) is distributed like the policy."""
    num_policy_workers: int = 1
    """Data-parallel policy workers (ranks) for --backend fsdp2 / deepspeed."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (1: optimizer state, 2: + gradients, 3: + parameters partitioned)."""
    use_ray: bool = True
    """Run the policy/rollout workers as Ray actors (False: in this process, for debugging)."""
    seed: int = 0
    """Seed for the model init, sampling and data order."""
    run_dir: str = "runs/latest"
    """Where checkpoints, metrics and the resolved config go."""
    save_rollouts: bool = True
    """Write every step's trajectories to run_dir/rollouts/step_NNNNNN.jsonl (inspect, replay)."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_last: int = 2
    """Checkpoints kept: the newest K (older ones are removed as new ones are written), plus the
    best one with --keep_best."""
    keep_best: str | None = None
    """Also keep the checkpoint with the best held-out value of this eval metric (pass@1,
    pass@K with K = --eval_samples, or mean_return); checkpoints/best names it. Needs
    --eval_every (each periodic eval saves a checkpoint to compare)."""
    resume: str | None = None
    """Resume from a checkpoint directory, or "auto" for the latest in run_dir."""
    eval_problems: int = 0
    """Held-out problems evaluated before and after training (0 = no eval)."""
    eval_every: int = 0
    """Also evaluate every N steps during training (0 = only before and after); logged as
    eval/<metric> beside the training curves. Needs --eval_problems."""
    eval_temperature: float = 1.0
    """Sampling temperature of the evals."""
    eval_samples: int = 1
    """Samples per eval problem (pass@k uses k = this)."""
    max_bad_steps: int = 3
    """Stop after this many steps with non-finite loss (each is skipped; a checkpoint is kept)."""
    tensorboard: bool = True
    """Also write TensorBoard event files."""
    progress: bool = True
    """Show a progress bar."""

    def eval_metrics(self) -> tuple[str, ...]:
        """The metrics an eval reports, which --keep_best can name."""
        return tuple(dict.fromkeys(("pass@1", f"pass@{self.eval_samples}", "mean_return")))

    def _check_evals_and_checkpoints(self) -> None:
        if self.eval_every < 0 or self.save_every < 0:
            raise ValueError("--eval_every and --save_every must be >= 0 (0 = off)")
        if self.keep_last < 1:
            raise ValueError(f"--keep_last must be >= 1 (the newest checkpoint is what a resume "
                             f"needs), got {self.keep_last}")
        if self.eval_every and not self.eval_problems:
            raise ValueError(f"--eval_every {self.eval_every} needs held-out problems to "
                             f"evaluate: set --eval_problems N (e.g. 32)")
        if self.keep_best is not None:
            metrics = self.eval_metrics()
            if self.keep_best not in metrics:
                hint = difflib.get_close_matches(self.keep_best, metrics, n=1)
                did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
                raise ValueError(f"--keep_best {self.keep_best!r} is not an eval metric."
                                 f"{did_you_mean} Choose one of: {', '.join(metrics)}")
            if not self.eval_every:
                raise ValueError(f"--keep_best {self.keep_best} compares the checkpoints of "
                                 f"periodic evals: set --eval_every N (and --eval_problems)")

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        ro = self.rollout
        if (self.algo.estimator in GROUP_ESTIMATORS and ro.n_samples_per_prompt < 2
                and not self.algo.pure_distillation):
            raise ValueError(
                f"--algo.estimator {self.algo.estimator} needs a group: set "
                f"--rollout.n_samples_per_prompt >= 2 (got {ro.n_samples_per_prompt})"
            )
        batch = ro.prompts_per_step * ro.n_samples_per_prompt
        if batch % self.minibatches_per_step:
            raise ValueError(
                f"--minibatches_per_step {self.minibatches_per_step} must divide the rollout "
                f"batch (--rollout.prompts_per_step x --rollout.n_samples_per_prompt = {batch})"
            )
        if self.micro_batch_size < 1 or self.steps < 0 or self.epochs_per_step < 1:
            raise ValueError("--micro_batch_size and --epochs_per_step must be >= 1, --steps >= 0")
        if self.eval_samples < 1:
            raise ValueError("--eval_samples must be >= 1")
        self._check_evals_and_checkpoints()
        from agentrl.backends import DISTRIBUTED, check_backend_name

        check_backend_name(self.backend, "--backend")
        if self.backend == "cpu" and self.actor.device.startswith("cuda"):
            raise ValueError(
                f"--backend cpu holds CPU-only speed-ups and trains on the CPU, but --actor.device "
                f"is {self.actor.device}: use --backend local (or auto) on a GPU"
            )
        if ro.enable_sleep and self.actor.device == "cpu":
            raise ValueError("--rollout.enable_sleep is vLLM's CUDA sleep mode, but --actor.device "
                             "is cpu: drop --rollout.enable_sleep, or use --actor.device cuda")
        if self.backend in DISTRIBUTED:
            if not self.use_ray or ro.mode != "placed":
                raise ValueError(
                    f"--backend {self.backend} runs ranks as Ray actors beside a separate "
                    f"rollout actor: set --use_ray true and --rollout.mode placed"
                )
            if self.backend == "deepspeed" and self.zero_stage not in (1, 2, 3):
                raise ValueError(
                    f"--zero_stage must be 1, 2 or 3 (1: optimizer state, 2: + gradients, "
                    f"3: + parameters partitioned), got {self.zero_stage}"
                )
            if batch % (self.num_policy_workers * self.minibatches_per_step):
                raise ValueError(
                    f"--num_policy_workers {self.num_policy_workers} x --minibatches_per_step "
                    f"{self.minibatches_per_step} must divide the rollout batch ({batch})"
                )
        elif self.num_policy_workers != 1:
            raise ValueError("--num_policy_workers > 1 needs --backend fsdp2 or deepspeed")
        if self.num_policy_workers > 1:
            check_sharded_4bit(self.actor, self.backend, self.zero_stage,
                               "--num_policy_workers")
        self._check_agent()
        self._check_dataset()
        self._check_warmup()

    def _check_warmup(self) -> None:
        w = self.warmup
        if not w.episodes:
            return
        if self.agent_run or self.replay or self.env in SINGLE_TURN_ENVS:
            raise ValueError("--warmup.episodes plays the env's scripted policy: it needs an "
                             "env run (--env), not --agent, --replay or --dataset")
        if self.algo.kl_coef > 0:
            raise ValueError("--warmup.episodes with --algo.kl_coef > 0: the KL reference would "
                             "be the model before the warm-up, pulling RL back from it; use "
                             "--algo.kl_coef 0, or warm up first (a run with --steps 0) and "
                             "train from its RUN_DIR/hf")
        if w.batch_size < self.num_policy_workers:
            raise ValueError(f"--warmup.batch_size {w.batch_size} must be >= "
                             f"--num_policy_workers {self.num_policy_workers} (each rank takes "
                             f"its share of a batch)")

    @property
    def agent_run(self) -> bool:
        """The run trains a black-box agent (--agent or --agent_cmd) through the proxy."""
        return bool(self.agent or self.agent_cmd)

    def _check_agent(self) -> None:
        """An agent run's flags go together; its task files are read and checked here, and its
        command's program found, before any model loads."""
        if not self.agent_run:
            if self.agent_eval_tasks:
                raise ValueError("--agent_eval_tasks holds an agent run's held-out tasks: it "
                                 "needs --agent or --agent_cmd")
            return
        flag = "--agent" if self.agent else "--agent_cmd"
        if self.agent and self.agent_cmd:
            raise ValueError("pass --agent (a Python function) or --agent_cmd (a command), not "
                             "both")
        if not (self.agent_tasks and (self.agent_reward or self.reward.url)):
            raise ValueError(f"{flag} needs --agent_tasks FILE.jsonl and --agent_reward "
                             f"module:fn (or --reward.url, a reward service: `agentrl "
                             f"reward-serve`)")
        if self.agent_reward and self.reward.url:
            raise ValueError(f"{flag}: pass --agent_reward (a function) or --reward.url (a "
                             f"reward service), not both")
        if self.reward.model:
            raise ValueError(f"--reward.model scores single-turn --dataset runs; an {flag} is "
                             f"scored by --agent_reward or --reward.url")
        if self.eval_problems and not self.agent_eval_tasks:
            raise ValueError(f"--eval_problems {self.eval_problems}: an agent run is evaluated "
                             f"on held-out tasks of its own: pass --agent_eval_tasks "
                             f"FILE.jsonl (or --eval_problems 0)")
        if self.agent_concurrency is not None and self.agent_concurrency < 1:
            raise ValueError(f"--agent_concurrency must be >= 1, got {self.agent_concurrency}")
        if not self.agent_timeout_s > 0:
            raise ValueError(f"--agent_timeout_s must be > 0, got {self.agent_timeout_s}")
        if self.agent_cmd is not None:
            from servers.agent_processes import command_argv

            command_argv(self.agent_cmd)
        load_tasks(self.agent_tasks, "--agent_tasks")
        if self.agent_eval_tasks:
            load_tasks(self.agent_eval_tasks, "--agent_eval_tasks")

    def _check_dataset(self) -> None:
        """--dataset and --reward_fn go together, with the single-turn env; the file, its
        prompt column and the reward function are checked here, before any model loads."""
        single = self.env in SINGLE_TURN_ENVS
        # An --agent's --reward.url scores its sessions (checked in __post_init__).
        scorer = None if self.agent_run else self.reward.url or self.reward.model
        if not (single or self.dataset.path or self.reward_fn or scorer):
            return
        if self.reward_fn and scorer:
            raise ValueError("pass one of --reward_fn (a local function), --reward.url (a "
                             "reward service) and --reward.model (a reward model), not several")
        if not (self.dataset.path and (self.reward_fn or scorer)):
            raise ValueError("single-turn RL needs both --dataset data.jsonl and --reward_fn "
                             "rewards.py:score (or a bare rewards.py with OpenRLHF's "
                             "reward_func(queries, prompts, labels), or --reward.url "
                             "http://HOST:PORT/score for an `agentrl reward-serve` service, or "
                             "--reward.model DIR for a reward model from `agentrl rm`)")
        if not single:
            raise ValueError(f"--dataset trains the single-turn env, but --env is {self.env}; "
                             f"drop --env (or pass --env single-turn)")
        from agentrl.data import read_rows
        from agentrl.rewards import reward_fn_from_spec

        for path in filter(None, (self.dataset.path, self.dataset.eval_path)):
            # Every row is read and checked here, before any model loads (the key's flag:
            # --dataset.prompt_key).
            read_rows(path, keys={self.dataset.prompt_key: "--dataset.prompt_key"},
                      what="--dataset")
        if self.reward_fn:
            reward_fn_from_spec(self.reward_fn)

    def single_turn_kwargs(self, *, eval_split: bool) -> dict[str, object]:
        """The single-turn env's arguments (`agentrl.rewards.SingleTurnEnv`)."""
        d, r = self.dataset, self.reward
        path = d.eval_path if eval_split and d.eval_path else d.path
        from agentrl.rewards import REWARD_MODEL_PREFIX

        remote: dict[str, object] = {}
        spec = self.reward_fn
        if r.url:
            spec = r.url
            remote = {"timeout_s": r.timeout_s, "retries": r.retries, "max_batch": r.max_batch}
        elif r.model:
            spec = REWARD_MODEL_PREFIX + str(Path(r.model).resolve())
            remote = {"max_batch": r.max_batch, "num_gpus": r.num_gpus}
        return {"dataset": path, "reward_fn": spec, "prompt_key": d.prompt_key,
                "label_key": d.label_key, "system_prompt": d.system_prompt,
                "reward_options": remote}

    @property
    def rollout_batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt

    @property
    def micro_batches_per_rank(self) -> int:
        """Forward/backward passes per optimizer step on each rank (DeepSpeed's accumulation)."""
        rows = self.rollout_batch_size // (self.num_policy_workers * self.minibatches_per_step)
        return max(1, -(-rows // self.micro_batch_size))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


def check_model_name(model: str) -> None:
    """ValueError (did-you-mean) unless --actor.model is a model's name or directory; builds
    nothing."""
    from agentrl.models import available_models, model_dir
    from agentrl.models.named import canonical_model_name

    if canonical_model_name(model) not in available_models():
        try:
            model_dir(model)  # a path, read as one: no model is built
        except ValueError as e:
            raise ValueError(f"--actor.model: {e}") from None


def check_model(cfg: TrainConfig) -> None:
    """The run's model against its engine and its env, told from names and config files
    (agentrl.models.named): a ValueError in one line naming the flags and the fix. Builds no
    model and starts nothing; `agentrl train` runs it before Ray starts. (TrainConfig's own
    checks compare flags with flags; this one reads the model and env registries.)"""
    from agentrl.models.named import check_engine_loads, sees_images

    model = cfg.actor.model
    check_model_name(model)
    check_engine_loads(cfg.rollout.engine, model, engine_flag="--rollout.engine",
                       model_flag="--actor.model")
    if cfg.algo.teacher is not None:
        check_teacher(cfg)
    if cfg.agent_run:
        return  # an outside agent's sessions: no env is built
    from agentrl.envs import resolve_env_id
    from agentrl.envs.registry import env_factory

    factory = env_factory(resolve_env_id(cfg.env))
    if getattr(factory, "shows_images", False) and sees_images(model) is False:
        raise ValueError(f"--env {cfg.env} shows images, but --actor.model {model} is a "
                         f"text-only model: use --actor.model embedded-vlm (the built-in "
                         f"vision-language model) or a vision-language model's directory")
    # An env class may offer `preflight(**env_kwargs)`: the checks of building it that start
    # nothing (MiniWoB: the browser and its driver installed, the task names), run here so that
    # a missing package is refused before a model loads rather than at the first rollout.
    preflight = getattr(factory, "preflight", None)
    if callable(preflight):
        evaluated = {**cfg.env_kwargs, **cfg.eval_env_kwargs}
        for kwargs in (cfg.env_kwargs, evaluated) if evaluated != cfg.env_kwargs else (evaluated,):
            try:
                preflight(**kwargs)
            except (RuntimeError, ValueError) as e:
                raise ValueError(f"--env {cfg.env}: {e}") from None


def check_teacher(cfg: TrainConfig) -> None:
    """--algo.teacher against the policy, before either loads: a model --rollout.engine can
    load, with the policy's vocabulary (its tokenizer read, no model), and one that sees images
    where the policy does."""
    from agentrl.models.named import check_engine_loads, sees_images
    from agentrl.models.vocabulary import check_shared_vocabulary

    teacher, model = cfg.algo.teacher, cfg.actor.model
    assert teacher is not None
    try:
        check_model_name(teacher)
    except ValueError as e:
        raise ValueError(str(e).replace("--actor.model", "--algo.teacher", 1)) from None
    check_engine_loads(cfg.rollout.engine, teacher, engine_flag="--rollout.engine",
                       model_flag="--algo.teacher")
    check_shared_vocabulary(model, teacher, model_flag="--actor.model", other_flag="--algo.teacher")
    if sees_images(model) and sees_images(teacher) is False:
        raise ValueError(f"--algo.teacher {teacher} is a text-only model, but --actor.model "
                         f"{model} sees images: the teacher must read the same screenshots; "
                         f"use a vision-language teacher")


def config_from_dict(d: dict, base: TrainConfig | None = None) -> TrainConfig:
    """Build a TrainConfig from a (possibly partial) nested dict, with unknown-key errors."""
    base = base or TrainConfig()
    return _merge(base, d, prefix="")


def _merge(obj: _D, d: dict, prefix: str) -> _D:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    updates: dict[str, object] = {}
    for key, value in d.items():
        if key not in fields:
            hint = difflib.get_close_matches(key, fields, n=1)
            did_you_mean = f"; did you mean '{prefix}{hint[0]}'?" if hint else ""
            raise ValueError(f"unknown config key '{prefix}{key}'{did_you_mean}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            assert not isinstance(current, type)  # a config section (an instance, not a class)
            updates[key] = _merge(current, value, prefix=f"{prefix}{key}.")
        elif isinstance(current, tuple) and isinstance(value, list):
            updates[key] = tuple(value)
        else:
            updates[key] = value
    return dataclasses.replace(obj, **updates)


def _check_name(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        hint = difflib.get_close_matches(value, allowed, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(
            f"{flag} {value!r} is unknown.{did_you_mean} Choose one of: {', '.join(allowed)}"
        )


def load_tasks(path: str | None, flag: str = "--agent_tasks") -> list[object]:
    """The tasks of a JSON-lines file (one JSON value a line; blank lines skipped), or a
    ValueError naming the flag, or the file and line that is not JSON."""
    if not path or not Path(path).is_file():
        raise ValueError(f"{flag} {path!r} does not exist")
    tasks = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tasks.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag}: {path}:{number} is not a JSON value ({e.msg}); the "
                                 f"file needs one JSON task a line") from None
    if not tasks:
        raise ValueError(f"{flag} {path} holds no tasks")
    return tasks
