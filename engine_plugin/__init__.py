"""engine_plugin package."""
