"""What the launcher and a training task agree on, owned below both of them.

`tfscale.launch` (a capability) and `tfscale-train` (a binary) both need these facts;
keeping them here lets the launcher read them without importing the binary above it.
"""

__all__ = ["DEFAULT_GLOBAL_BATCH_SIZE"]

DEFAULT_GLOBAL_BATCH_SIZE = 64  # what `--global_batch_size` means when neither batch flag is given
