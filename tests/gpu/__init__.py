"""The CUDA suite (``make test-gpu``); its bodies run on the CPU in ``make test``."""
