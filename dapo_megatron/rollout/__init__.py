"""Rollouts from SGLang: `engine` runs the server process, `client` sends generation requests to it.

Importing this package loads neither SGLang nor transformers nor megatron."""
