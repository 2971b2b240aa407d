"""The patched llama-server as kvctl sees it: typed models (controller.upstream.models, plain pydantic) and an
aiohttp client (controller.upstream.client). Import from those modules: this package's own import loads nothing,
so a reader of the models does not load aiohttp."""
