"""dflash: train DFlash speculative-decoding drafters offline, from harvested target hidden states."""

__version__ = "0.1.0"
