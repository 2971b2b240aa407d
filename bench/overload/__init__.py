"""The overload benchmark: ``python -m bench.overload [--quick]`` (see __main__.py)."""
