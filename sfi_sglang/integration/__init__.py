"""The SGLang side: the `sfi` attention backend and its request slots, the radix cache,
the hooks, grammar backends, metrics, tensor parallelism and the start-up stand-ins."""
