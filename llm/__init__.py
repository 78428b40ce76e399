"""zerollm: train decoder-only language models end to end under DeepSpeed ZeRO."""

__version__ = "0.1.0"
