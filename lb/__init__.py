"""lb package."""
