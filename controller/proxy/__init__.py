"""The client-facing reverse proxy: streams that survive parking, admission that protects running chats."""

from controller.proxy.admission import AdmissionGate, AdmissionQueue, QueueFull, QueueTimeout
from controller.proxy.app import ProxyConfig, make_proxy_app
from controller.proxy.sse import SSEFramer

__all__ = [
    "AdmissionGate",
    "AdmissionQueue",
    "ProxyConfig",
    "QueueFull",
    "QueueTimeout",
    "SSEFramer",
    "make_proxy_app",
]
