"""TensorFlow's start-up lines that tfscale's binaries drop: exact known lines, nothing else.

Importing TensorFlow 2.21 prints, before its C++ logging is initialised (so
`TF_CPP_MIN_LOG_LEVEL` cannot stop them), a notice about absl::InitializeLog, the
oneDNN notice and "Could not find cuda drivers" -- twice, once per copy of the
logging library its two native modules carry -- and on a machine without a GPU,
"failed call to cuInit" when the devices are listed. None of them says anything
about the job. The binaries import TensorFlow through `import_tensorflow()`, which
sends stderr to a file for that moment and replays every other line.
"""

import os
import re
import sys
import tempfile

__all__ = ["import_tensorflow", "is_startup_noise"]

_NOISE = re.compile(
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    r"|^[IWE]\d{4} [\d:. ]+ +\d+ (?:"
    r"port\.cc:\d+\] oneDNN custom operations are on"
    r"|cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
    r"|cuda_platform\.cc:\d+\] failed call to cuInit"
    r"|cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized)"
    r"|^To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.$"
)


def is_startup_noise(line):
    """True for one of TensorFlow's known start-up lines (see the module docstring)."""
    return bool(_NOISE.search(line.rstrip("\r\n")))


def import_tensorflow():
    """Imports TensorFlow and lists its devices with the known start-up lines left out of stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices("GPU")  # cuInit's line comes here, not at import.
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                if not is_startup_noise(line)
            ]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
