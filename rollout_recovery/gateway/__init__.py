"""OpenAI-compatible rollout gateway: one base URL per rollout, backed by its durable episode."""

from rollout_recovery.gateway.app import create_app
from rollout_recovery.gateway.server import GatewayServer
from rollout_recovery.gateway.wire import (
    CallRefused,
    ChatCompletionBody,
    GatewayBackend,
    GatewayError,
    GatewayReply,
    RequestRejected,
    RolloutFinished,
    UnknownRollout,
    completion_to_chunks,
    parse_chat_body,
)

__all__ = [
    "CallRefused",
    "ChatCompletionBody",
    "GatewayBackend",
    "GatewayError",
    "GatewayReply",
    "GatewayServer",
    "RequestRejected",
    "RolloutFinished",
    "UnknownRollout",
    "completion_to_chunks",
    "create_app",
    "parse_chat_body",
]
