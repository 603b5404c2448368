"""YAML presets (installed as ``specdec.configs``); load them with ``specdec.config.load_yaml(name)``."""
