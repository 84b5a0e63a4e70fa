"""Environments: the token-level base, chat authoring, registry."""

from agentrl.envs.base import Obs, TokenEnv, make_obs, validate_action
from agentrl.envs.chat import ChatEnv, ChatTokenEnv
from agentrl.envs.registry import list_envs, load_plugins, make_env, register, resolve_env_id
from agentrl.envs.template import ChatTemplateBridge, DriftReport, TemplateError

__all__ = [
    "ChatEnv",
    "ChatTemplateBridge",
    "ChatTokenEnv",
    "DriftReport",
    "Obs",
    "TemplateError",
    "TokenEnv",
    "list_envs",
    "load_plugins",
    "make_env",
    "make_obs",
    "register",
    "resolve_env_id",
    "validate_action",
]
