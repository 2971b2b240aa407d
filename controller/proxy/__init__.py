"""The client-facing reverse proxy: streams that survive parking, admission that protects running chats.

Import what you need from its modules (controller.proxy.app, .admission, .sse): this package's own import loads
nothing, so a module that needs one piece of the proxy does not load aiohttp and the rest with it.
"""
