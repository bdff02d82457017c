"""Whether this machine can run the CUDA suite (imports torch only: the
first thing tools/gpu-check.sh asks, before anything is built)."""

from __future__ import annotations

import torch


def cuda_unavailable_reason() -> str | None:
    """Why this machine cannot run the CUDA suite (None: it can)."""
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a build without CUDA "
            "(install a CUDA build of torch, see tools/gpu-check.sh)"
        )
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable CUDA device"
    return None


if __name__ == "__main__":
    # "<torch version>\t<reason, empty when CUDA is usable>"
    print(f"{torch.__version__}\t{cuda_unavailable_reason() or ''}")
