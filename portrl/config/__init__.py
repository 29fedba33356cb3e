"""Run configuration: the structured schema, presets and their composition."""
