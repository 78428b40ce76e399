"""zerollm: train decoder-only language models end to end under DeepSpeed ZeRO."""

from llm.own_kernels import check_own_kernels

__version__ = "0.1.0"

check_own_kernels()
