"""`ChatEnv`: what most authors write (messages in, assistant text out), and `ChatTokenEnv`,
the bridge that serves it as a token-level `TokenEnv` for a given tokenizer.

    class Echo(agentrl.ChatEnv):
        def reset(self, *, seed=None, options=None):
            return [{"role": "user", "content": "Say hi"}]
        def step(self, text):
            return [], float("hi" in text.lower()), True, False, {}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from agentrl.envs.base import Obs, TokenEnv, make_obs, validate_action
from agentrl.envs.template import ChatTemplateBridge, Message, TemplateError, message_images

if TYPE_CHECKING:
    from agentrl.models.vision import VisionProcessor

StepResult = tuple[list[Message], float, bool, bool, dict[str, Any]]

OnRewrite = Literal["segment", "report"]
ON_REWRITE: tuple[OnRewrite, ...] = ("segment", "report")

DEFAULT_IMAGE_TOKENIZER = "embedded-vlm"
"""The tokenizer an env that shows images gets when given none: the embedded vision-language
model's (a named model, `agentrl.models.named`, built on first use)."""


class ChatEnv:
    """Text-level environment. Subclass and implement `reset` and `step`.

    - `reset(seed=, options=)` returns the opening messages (or `(messages, info)`).
    - `step(assistant_text)` returns `(new_messages, reward, terminated, truncated, info)`;
      `new_messages` are what the policy sees next (user / tool messages).
    - `self.np_random` is a seeded `numpy.random.Generator`, set before each `reset`.
    - `tools` (OpenAI function schemas) are rendered through the chat template; where the
      template ignores them, into the system message (`agentrl.envs.tool_calls.fold_tools`),
      unless the class sets `fold_tools = False` (its prompt explains its tools itself).
    - `oracle_action()` (optional) answers the current observation with a scripted policy.
    - Images go in list-of-parts content, `{"type": "image", "image": uint8 HxWx3}`. An env
      that shows images sets the class attribute `shows_images = True` (so the bridge defaults
      to a vision-language model and refuses a text-only one) and `image_shape` (H, W, 3), the
      shape of its observation space's images.
    """

    tools: list[dict] | None = None
    fold_tools: ClassVar[bool] = True
    shows_images: ClassVar[bool] = False
    image_shape: tuple[int, int, int] | None = None
    np_random: np.random.Generator

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> list[Message] | tuple[list[Message], dict[str, Any]]:
        raise NotImplementedError

    def step(self, assistant_text: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (sandboxes, files). Called when the token env closes."""

    def oracle_action(self) -> str:
        """Optional: a scripted policy's answer to the current observation, in the env's own
        action language, for a supervised warm-up before RL (`--warmup.episodes`,
        `agentrl.rollout.scripted`). Envs without one leave this as it is."""
        raise NotImplementedError(f"{type(self).__name__} has no scripted policy")


def shows_images(chat_env: ChatEnv) -> bool:
    """Whether a chat env's observations hold images: it says so (`shows_images`) or gives
    their shape (`image_shape`)."""
    return bool(chat_env.shows_images) or getattr(chat_env, "image_shape", None) is not None


def _vision_of(tokenizer: Any, env_name: str) -> VisionProcessor:
    """The image path of the tokenizer's model, or a one-line error naming the fix (instead of
    the Jinja error a text-only chat template raises at the first image)."""
    from agentrl.models.vision import ImageError, vision_processor

    vision = vision_processor(tokenizer)
    if vision is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ImageError(
            f"{env_name} shows images, but tokenizer {name!r} belongs to a text-only model; pass "
            f"tokenizer={DEFAULT_IMAGE_TOKENIZER!r} (the default, built in) or a vision-language "
            f"model's name or directory (e.g. tokenizer='/models/Qwen2.5-VL-3B-Instruct')"
        )
    return vision


class ChatTokenEnv(TokenEnv):
    """Serves a `ChatEnv` at token level for one tokenizer.

    The prompt and every observation are rendered incrementally with the tokenizer's chat
    template; the policy's sampled tokens are appended exactly as sampled. After each step the
    running sequence is compared with a full re-render (`check_drift`): differences are
    reported in `info["drift"]` and counted in `info["drift_events"]`, never raised.

    A template that rewrites history (Qwen3's drops earlier turns' `<think>...</think>`) shows
    the model a context that does not extend the running one. With `on_rewrite="segment"`
    (the default) the next observation is then that context, whole, with
    `info["new_segment"] = True`: the episode goes on in a new segment (`agentrl.segments`)
    that the rollout loop records as a trajectory of its own, so every prompt is what the
    template showed and every action what was sampled; `info["segments"]` counts them, and
    they are not drift. `on_rewrite="report"` keeps appending (the model then sees its earlier
    reasoning, which the template would not show it) and reports each such step as drift.
    Either needs `check_drift` (the re-render); without it nothing is compared.

    Turn and token budgets are not the bridge's: the rollout loop enforces them for every env
    (`agentrl.rollout.collect(max_turns=, max_episode_tokens=)`). The bridge ends an episode
    only when the chat env does, or when the template cannot render it (`template_error`).

    Images in messages are expanded by `vision` (default: the tokenizer's model's, see
    `agentrl.models.vision.vision_processor`). A chat env that shows images
    (`ChatEnv.shows_images`, or an `image_shape`) defaults to `DEFAULT_IMAGE_TOKENIZER` and
    refuses, when built, a tokenizer whose model cannot see.
    """

    def __init__(
        self,
        chat_env: ChatEnv,
        tokenizer: Any = None,
        *,
        check_drift: bool = True,
        vision: VisionProcessor | None = None,
        on_rewrite: OnRewrite = "segment",
    ) -> None:
        from agentrl.models import resolve_tokenizer

        if not isinstance(chat_env, ChatEnv):
            raise TypeError(f"ChatTokenEnv wraps a ChatEnv, got {type(chat_env).__name__}")
        if on_rewrite not in ON_REWRITE:
            raise ValueError(f"on_rewrite={on_rewrite!r}: expected one of {ON_REWRITE} (a "
                             f"template that rewrites history starts a new segment, or is "
                             f"reported as drift)")
        self.on_rewrite = on_rewrite
        self.chat_env = chat_env
        images = shows_images(chat_env)
        if tokenizer is None and images and vision is None:
            tokenizer = DEFAULT_IMAGE_TOKENIZER
        self.tokenizer = resolve_tokenizer(tokenizer)
        if images and vision is None:
            vision = _vision_of(self.tokenizer, type(chat_env).__name__)
        self.bridge = ChatTemplateBridge(
            self.tokenizer, getattr(chat_env, "tools", None), vision,
            fold_tools=getattr(chat_env, "fold_tools", True),
        )
        self.check = check_drift
        shape = getattr(chat_env, "image_shape", None)
        if shape is None:
            self._init_spaces(len(self.tokenizer))
        else:
            self._init_spaces(len(self.tokenizer), tuple(shape))
        self._messages: list[Message] = []
        self._tokens: list[int] = []
        self._turn = 0
        self._drift_events = 0
        self._segments = 1
        self._done = True

    @property
    def messages(self) -> list[Message]:
        """The conversation so far, as text messages."""
        return list(self._messages)

    @property
    def token_ids(self) -> list[int]:
        """The running token sequence (prompt, actions and observations)."""
        return list(self._tokens)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Obs, dict[str, Any]]:
        super(TokenEnv, self).reset(seed=seed)
        self.chat_env.np_random = self.np_random
        out = self.chat_env.reset(seed=seed, options=options)
        messages, info = out if isinstance(out, tuple) else (out, {})
        if not messages:
            raise ValueError(f"{type(self.chat_env).__name__}.reset returned no messages")
        self._messages = [dict(m) for m in messages]
        self._tokens = self.bridge.prompt_ids(self._messages)
        self._turn, self._drift_events, self._segments, self._done = 0, 0, 1, False
        info = {**info, "turn": 0, "drift_events": 0, "segments": 1}
        return make_obs(self._tokens, message_images(self._messages)), info

    def step(self, action: Any) -> tuple[Obs, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        ids = validate_action(action, self.vocab_size).tolist()
        text, _closed = self.bridge.split_action(ids)
        new, reward, terminated, truncated, info = self._chat_step(text)
        self._tokens.extend(ids)
        self._messages.append({"role": "assistant", "content": text})
        self._turn += 1
        info = dict(info)
        obs_ids: list[int] = []
        images: tuple[np.ndarray, ...] = ()
        if not (terminated or truncated):
            truncated, obs_ids, images = self._next_observation(ids, new, info)
        if not (terminated or truncated):
            self._messages.extend(dict(m) for m in new)
            self._tokens.extend(obs_ids)
        elif new:
            info["final_messages"] = list(new)
        self._done = terminated or truncated
        if self.check:
            segment = self._compare(info)
            if segment is not None:
                obs_ids, images = segment, message_images(self._messages)
        info.update(turn=self._turn, drift_events=self._drift_events, segments=self._segments)
        return make_obs(obs_ids, images), reward, terminated, truncated, info

    def _chat_step(self, text: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        name = type(self.chat_env).__name__
        out = self.chat_env.step(text)
        if not (isinstance(out, tuple) and len(out) == 5):
            raise TypeError(
                f"{name}.step must return (new_messages, reward, terminated, truncated, info), "
                f"got {type(out).__name__}"
            )
        new, reward, terminated, truncated, info = out
        if isinstance(reward, bool) or not isinstance(reward, int | float | np.number):
            raise TypeError(f"{name}.step returned reward {reward!r}; expected a float")
        if not math.isfinite(float(reward)):
            raise ValueError(f"{name}.step returned a non-finite reward {reward!r}")
        return list(new or []), float(reward), bool(terminated), bool(truncated), dict(info or {})

    def _next_observation(
        self, ids: list[int], new: Sequence[Message], info: dict[str, Any]
    ) -> tuple[bool, list[int], tuple[np.ndarray, ...]]:
        """Render the next observation; returns (truncated, obs ids, images)."""
        try:
            obs_ids = self.bridge.observation_ids(ids, new)
        except TemplateError as e:
            # Never crash the episode: end it as truncated and say why.
            info["template_error"] = str(e)
            return True, [], ()
        return False, obs_ids, message_images(new)

    def _compare(self, info: dict[str, Any]) -> list[int] | None:
        """Compare the running sequence with a full re-render. Where the template rewrote
        history and the episode goes on in segments, start one: its prompt's ids. Otherwise
        report a difference as drift; None."""
        report, ids = self.bridge.rerender(
            self._messages, self._tokens, turn=self._turn, open_turn=not self._done
        )
        if report is None:
            return None
        if report.kind == "template" and self.on_rewrite == "segment":
            if self._done:
                return None  # nothing follows: no context to show, no segment to start
            self._tokens = ids
            self._segments += 1
            info["new_segment"] = True
            return ids
        self._drift_events += 1
        info["drift"] = report.as_dict()
        return None

    def close(self) -> None:
        self.chat_env.close()
        super().close()

