"""entrypoint package."""
