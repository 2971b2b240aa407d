"""The admin listener (controller.admin.app), its wire models (controller.admin.models, plain pydantic, what the CLI
reads) and the status built from the loop's state (controller.admin.status). This package's own import loads
nothing."""
