"""torchtitan integration: CPU shims and ready model builders (import boundpass.recipes)."""
