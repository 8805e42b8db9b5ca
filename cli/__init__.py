"""The `ws` command."""
