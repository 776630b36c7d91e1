"""integrations.llamafactory."""
