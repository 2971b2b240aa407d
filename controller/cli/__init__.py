"""``kvctl run | status | park | resume``: the parser and ``run`` (controller.cli.main), the admin API's clients
with their exit codes (controller.cli.client), and the text view of the status (controller.cli.render)."""
