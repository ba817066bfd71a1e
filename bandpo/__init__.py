"""bandpo: RLVR for LLM math reasoning with BandPO."""

__version__ = "0.1.0"
